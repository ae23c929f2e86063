"""Causal varlen attention of prefill chunks over the paged KV cache (cached prefix + the chunk itself).

One program per (tile of BLOCK_M queries, query head -- or several of one KV head's --, request). Every key,
of the cached context and of the chunk alike, is read from the paged cache through the block table (the
chunk's own K/V were stored first), in tiles of BLOCK_N keys with an online softmax in fp32. One request::

    keys:     0 ................ context_len ................ seq_len
              <--- cached context ---><------- this chunk ------->
    queries:                          q0 q1 ...            q_{query_len-1}
                                      query i sits at position context_len + i, sees keys 0..that

For a query tile starting at position P, keys [0, P) are visible to every query of the tile, so those
tiles (rounded down to BLOCK_N) skip the causal mask; the remaining tiles up to the tile's last
position apply it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.fp8 import kv_compute_dtype
from nanovllm.kernels.jit import INTERPRETED, jit_unspecialized

LOG2E = math.log2(math.e)


@triton.jit
def _attend_key_tiles(
    acc, m_i, l_i,               # running output [BLOCK_M, HEAD_DIM], max and sum [BLOCK_M] (log2 domain)
    q,                           # [BLOCK_M, HEAD_DIM]
    positions,                   # [BLOCK_M] absolute position of each query
    k_cache_ptr, v_cache_ptr,    # already offset to this kv head
    k_desc, v_desc, kv_column,   # with TMA: the caches' descriptors and this kv head's first column in them
    table_row,                   # block_tables_ptr offset to this request's row
    key_start, key_end,          # keys [key_start, key_end); key_start is a multiple of BLOCK_N
    scale_log2, cache_stride_block, cache_stride_token,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,   # False: every key of every tile is visible to every query
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,        # the cache is e4m3: tiles are upcast to q's dtype (the products') as they load
    TMA: tl.constexpr,           # tiles lie within one cache block and are copied whole by the descriptors
):
    dims = tl.arange(0, HEAD_DIM)
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < key_end
        if TMA:
            block_id = tl.load(table_row + start // BLOCK_SIZE)
            cache_row = block_id * BLOCK_SIZE + start % BLOCK_SIZE
            k = tl.trans(k_desc.load([cache_row, kv_column]))  # [HEAD_DIM, BLOCK_N]
        else:
            if CAUSAL_MASK:
                block_ids = tl.load(table_row + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
            else:
                block_ids = tl.load(table_row + keys // BLOCK_SIZE).to(tl.int64)
            # key_offsets: [BLOCK_N], element offset of each key's row in the cache
            key_offsets = block_ids * cache_stride_block + (keys % BLOCK_SIZE) * cache_stride_token
            if CAUSAL_MASK:
                # k: [HEAD_DIM, BLOCK_N], loaded transposed for q @ k
                k = tl.load(k_cache_ptr + key_offsets[None, :] + dims[:, None], mask=key_mask[None, :], other=0.0)
            else:
                k = tl.load(k_cache_ptr + key_offsets[None, :] + dims[:, None])
        if KV_FP8:
            k = k.to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
        if CAUSAL_MASK:
            visible = (keys[None, :] <= positions[:, None]) & key_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        # The scale (> 0) is applied to the row maxima and folded into the exponent's subtraction (one fused
        # multiply-add a score). Key 0 is visible to every query row (padding rows too) and comes first, so m_i
        # is finite after the first tile and a fully masked row in a later tile gives alpha = 1, p = 0.
        m_new = tl.maximum(m_i, tl.max(scores, 1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # v: [BLOCK_N, HEAD_DIM]
        if TMA:
            v = v_desc.load([cache_row, kv_column])
            if CAUSAL_MASK:  # rows past key_end hold whatever the block held: p is 0 there, but 0 * NaN is not
                v = tl.where(key_mask[:, None], v, 0.0)
        elif CAUSAL_MASK:
            v = tl.load(v_cache_ptr + key_offsets[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
        else:
            v = tl.load(v_cache_ptr + key_offsets[:, None] + dims[None, :])
        if KV_FP8:
            v = v.to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@jit_unspecialized("block_tables_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_stride")
def _prefill_attention_kernel(
    q_ptr,                       # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,    # [num_blocks, block_size, num_kv_heads, head_dim] (contiguous)
    k_desc, v_desc,              # with TMA: descriptors of the caches as [num_blocks * block_size, kv heads * head_dim]
    block_tables_ptr,            # [num_seqs, max_blocks] int32
    cu_seqlens_q_ptr,            # [num_seqs + 1] int32
    seq_lens_ptr,                # [num_seqs] int32, context_len + query_len
    out_ptr,                     # [num_tokens, num_heads, head_dim]
    scale_log2,                  # softmax scale * log2(e) (* k_scale for an fp8 cache): scores go through exp2
    v_scale,                     # an fp8 cache's V scale, applied to the output; read only when KV_FP8
    q_stride_token, q_stride_head,
    out_stride_token, out_stride_head,
    block_tables_stride,
    cache_stride_block, cache_stride_token,
    GROUP: tl.constexpr,         # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,    # tokens per cache block
    BLOCK_M: tl.constexpr,       # queries per tile
    BLOCK_N: tl.constexpr,       # keys per tile; a tile may span blocks or be part of one
    HEADS: tl.constexpr,         # query heads of one kv head in a program: they share each K/V tile it loads
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    COMPUTE: tl.constexpr,       # the products' dtype: q's, or float16 over an fp8 cache (fp8.kv_compute_dtype)
    TMA: tl.constexpr,           # K/V tiles copied by the descriptors (BLOCK_SIZE a multiple of BLOCK_N), not gathered
):
    # The last query tiles see the most keys: they start first, so the lightest tiles fill the final wave.
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head_group = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= query_len:
        return  # the grid is sized for the longest chunk
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # HEADS x BLOCK_M rows: row r is query (r % BLOCK_M) of the tile for head (r // BLOCK_M) of the group
    tile_rows = tl.arange(0, HEADS * BLOCK_M)
    heads = head_group * HEADS + tile_rows // BLOCK_M
    rows = q_tile * BLOCK_M + tile_rows % BLOCK_M
    row_mask = rows < query_len
    positions = context_len + rows  # padding rows sit past seq_len: they see every key, never stored
    dims = tl.arange(0, HEAD_DIM)
    tokens = (q_start + rows).to(tl.int64)
    # q: [HEADS * BLOCK_M, HEAD_DIM]
    q = tl.load(q_ptr + tokens[:, None] * q_stride_token + heads[:, None] * q_stride_head + dims[None, :],
                mask=row_mask[:, None], other=0.0).to(COMPUTE)

    kv_head_offset = (head_group * HEADS // GROUP) * HEAD_DIM  # also the head's first column in a descriptor
    k_head_ptr = k_cache_ptr + kv_head_offset
    v_head_ptr = v_cache_ptr + kv_head_offset
    table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride

    m_i = tl.full([HEADS * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS * BLOCK_M], tl.float32)
    acc = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], tl.float32)
    first_position = context_len + q_tile * BLOCK_M
    unmasked_end = (first_position // BLOCK_N) * BLOCK_N
    key_end = tl.minimum(first_position + BLOCK_M, seq_len)
    acc, m_i, l_i = _attend_key_tiles(
        acc, m_i, l_i, q, positions, k_head_ptr, v_head_ptr, k_desc, v_desc, kv_head_offset, table_row,
        0, unmasked_end,
        scale_log2, cache_stride_block, cache_stride_token,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, KV_FP8, TMA,
    )
    acc, m_i, l_i = _attend_key_tiles(
        acc, m_i, l_i, q, positions, k_head_ptr, v_head_ptr, k_desc, v_desc, kv_head_offset, table_row,
        unmasked_end, key_end,
        scale_log2, cache_stride_block, cache_stride_token,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, KV_FP8, TMA,
    )

    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * v_scale
    tl.store(out_ptr + tokens[:, None] * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel."""

    block_m: int      # queries per tile
    block_n: int      # keys per tile
    num_warps: int
    num_stages: int
    heads: int = 1    # query heads of a KV head per program (a divisor of the GQA group): one K/V load serves all
    tma: bool | None = None  # K/V tiles copied by tensor descriptors; None: where the GPU has them (sm_90+)
                             # and a cache block holds whole tiles. Otherwise each key's row is gathered.


def uses_tma(config: PrefillConfig, block_size: int, device: torch.device) -> bool:
    """Whether a launch copies K/V tiles by descriptor: asked for (the interpreter runs descriptors too, for the
    tests) or left to the device, and possible only where every BLOCK_N-key tile lies inside one cache block."""
    fits = block_size % config.block_n == 0
    if config.tma is not None:
        assert fits or not config.tma, f"TMA tiles of {config.block_n} keys need cache blocks of a multiple of them, " \
                                       f"got {block_size}"
        return config.tma
    return fits and device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9


def default_prefill_config(head_dim: int, dtype: torch.dtype, group: int, block_size: int,
                           device: torch.device) -> PrefillConfig:
    """Where K/V tiles can be copied by descriptor: 16 KiB tiles (16-bit head_dim 128: 64 queries x 64 keys), three
    stages and two query heads sharing each K/V tile, the best of the H100 sweep in docs/benchmarks.md. Otherwise a
    32 KiB query tile and two stages of 32 KiB gathered K and V tiles, the best gathered tiling. Larger rows shrink
    the tiles."""
    row_bytes = head_dim * dtype.itemsize
    tile = min(64, max(16, 16384 // row_bytes))
    copied = PrefillConfig(block_m=tile, block_n=tile, num_warps=4, num_stages=3, heads=2 if group % 2 == 0 else 1)
    if uses_tma(copied, block_size, device):
        return copied
    block_m = min(128, max(32, 32768 // row_bytes))
    block_n = min(128, max(16, 32768 // row_bytes))
    return PrefillConfig(block_m=block_m, block_n=block_n, num_warps=8 if block_m == 128 else 4, num_stages=2,
                         tma=False)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int, *,
                      out: torch.Tensor | None = None, config: PrefillConfig | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each request's query chunk over its cached context plus itself.

    q: [num_tokens, num_heads, head_dim], requests packed by cu_seqlens_q (any token/head strides,
    unit stride on head_dim); k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim],
    contiguous, q's dtype or fp8 (e4m3) holding K / k_scale and V / v_scale, already holding the chunk's own K/V.
    block_tables: [num_seqs, max_blocks] int32; cu_seqlens_q: [num_seqs + 1] int32 (cu_seqlens_q[0] == 0);
    seq_lens: [num_seqs] int32 = context_len + query_len.
    max_query_len: a python int >= every query_len (sizes the grid; no host sync).
    out: optional [num_tokens, num_heads, head_dim] destination. Returns out, in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert cache_head_dim == head_dim, f"cache head_dim {cache_head_dim} != q head_dim {head_dim}"
    assert v_cache.shape == k_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert k_cache.dtype == v_cache.dtype and (kv_fp8 or q.dtype == k_cache.dtype), \
        f"q {q.dtype} and caches {k_cache.dtype}, {v_cache.dtype} must match (or the caches be fp8)"
    assert kv_fp8 or k_scale == v_scale == 1.0, f"scales {k_scale}, {v_scale} given for a {k_cache.dtype} cache"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two >= 16"
    assert q.stride(-1) == 1, "q's head_dim must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1
    assert cu_seqlens_q.shape == (num_seqs + 1,) and cu_seqlens_q.dtype == torch.int32
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and cu_seqlens_q.is_contiguous()
    assert q.device == k_cache.device == block_tables.device == cu_seqlens_q.device == seq_lens.device
    assert num_seqs <= 65535, "grid dimension z is limited to 65535 requests"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_seqs == 0 or max_query_len <= 0:
        return out

    group = num_heads // num_kv_heads
    config = config or default_prefill_config(head_dim, q.dtype, group, block_size, q.device)
    assert group % config.heads == 0 and config.heads & (config.heads - 1) == 0, \
        f"heads a program {config.heads} must be a power of two dividing the GQA group of {group}"
    grid = (triton.cdiv(max_query_len, config.block_m), num_heads // config.heads, num_seqs)
    tma = uses_tma(config, block_size, q.device)
    k_desc = v_desc = None
    if tma:
        # rows are (block, token) pairs and a kv head is head_dim columns: a tile is one box of BLOCK_N rows
        shape, strides = [num_blocks * block_size, num_kv_heads * head_dim], [num_kv_heads * head_dim, 1]
        k_desc, v_desc = (TensorDescriptor(cache, shape, strides, [config.block_n, head_dim])
                          for cache in (k_cache, v_cache))
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, block_tables, cu_seqlens_q, seq_lens, out,
        scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEADS=config.heads,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=kv_fp8,
        COMPUTE=kv_compute_dtype(q.dtype, kv_fp8), TMA=tma, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
