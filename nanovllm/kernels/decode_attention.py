"""Split-K ("flash-decoding") attention of one query token per request over the paged KV cache.

Two kernels. The split kernel runs one program per (request, kv head, split): it walks its split's
range of the request's keys in tiles of BLOCK_N tokens, looking up each token's block in the block
table, and computes every query head of the GQA group against each tile it loads (the group is one
[BLOCK_GROUP, head_dim] tile, padded to 16 rows so it can feed ``tl.dot``), so each K/V byte is read
once. It leaves a partial (running max, running sum, unnormalised output) per split; the reduce
kernel rescales and sums the splits. With a single split the split kernel writes the output itself.

Splits of one request::

    keys:   0 ........ T ........ 2T ........ 3T ... seq_len       (T = tokens_per_split of this request:
            |-split 0--|--split 1--|--split 2--|--...-|         seq_len / num_splits in whole tiles, >= a minimum)
    a split past seq_len has no keys: it writes max = -inf, sum = 0 and the reduction gives it weight 0.
    The number of splits is planned from max_seq_len (a CUDA graph's bound); each request's split length from its
    own seq_len, so a short request in a graph planned for a long one still spreads over the whole grid.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import e4m3_to_f16_in_registers, kv_compute_dtype
from nanovllm.kernels.jit import (
    INTERPRETED,
    jit_unspecialized,
    num_sms,
    overlap_options,
    wait_for_prior_kernel,
)

LOG2E = math.log2(math.e)
# The shortest split the plan makes: one 64-key tile. At a few requests a step's attention is latency, not bytes:
# each program walks its keys one tile after another, so shorter splits over more programs finish sooner, even
# with the reduce reading more partials (256 before; docs/benchmarks.md, 2026-12-07).
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64
# Programs per SM that choose_num_splits aims for. 8 beat 16 on the H200 (W1 +2.6 %, W2 +3.3 %): at 256
# requests x 8 KV heads it takes one split, which skips the reduce kernel.
PROGRAMS_PER_SM = 8


@jit_unspecialized("block_tables_ptr", "seq_lens_ptr", "block_tables_stride", "num_splits")
def _decode_split_kernel(
    q_ptr,                      # [num_seqs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,   # [num_blocks, block_size, num_kv_heads, head_dim] (contiguous)
    block_tables_ptr,           # [num_seqs, max_blocks] int32
    seq_lens_ptr,               # [num_seqs] int32
    out_ptr,                    # [num_seqs, num_heads, head_dim]; written only when WRITE_OUT
    partial_max_ptr,            # [num_seqs, num_heads, num_splits] fp32 (log2 domain)
    partial_sum_ptr,            # [num_seqs, num_heads, num_splits] fp32
    partial_acc_ptr,            # [num_seqs, num_heads, num_splits, head_dim] fp32, unnormalised
    scale_log2,                 # softmax scale * log2(e) (* k_scale for an fp8 cache): scores go through exp2
    v_scale,                    # an fp8 cache's V scale, applied to the output; read only when KV_FP8
    min_tokens_per_split,       # a multiple of BLOCK_N
    num_splits,
    q_stride_seq, q_stride_head,
    out_stride_seq, out_stride_head,
    block_tables_stride,
    cache_stride_block, cache_stride_token,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,        # query heads per kv head
    BLOCK_GROUP: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum M)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,   # tokens per cache block
    BLOCK_N: tl.constexpr,      # keys per tile; a tile may span blocks or be part of one
    WRITE_OUT: tl.constexpr,    # num_splits == 1: normalise and write out, skip the partials
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,       # the cache is e4m3: tiles are upcast to COMPUTE as they load
    V_ASM_UPCAST: tl.constexpr, # KV_FP8 on sm_89+: V through e4m3_to_f16_in_registers (fp8.py says why)
    COMPUTE: tl.constexpr,      # the dtype of the products: q's, or float16 over an fp8 cache of 16-bit q
    OVERLAP: tl.constexpr,      # launched overlapped with the kernel before (kernels/jit.py)
):
    wait_for_prior_kernel(OVERLAP)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Each request spreads its own keys over every split (whole tiles, at least min_tokens_per_split a split),
    # so a graph whose split plan was made for max_model_len still reads a shorter request with the whole grid.
    tile_count = (seq_len + num_splits * BLOCK_N - 1) // (num_splits * BLOCK_N)
    tokens_per_split = tl.maximum(tile_count * BLOCK_N, min_tokens_per_split)
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    groups = tl.arange(0, BLOCK_GROUP)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + groups
    group_mask = groups < GROUP
    # q: [BLOCK_GROUP, HEAD_DIM]; padding rows are zero (finite scores, never stored)
    q = tl.load(q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :],
                mask=group_mask[:, None], other=0.0).to(COMPUTE)

    m_i = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_GROUP], tl.float32)
    acc = tl.zeros([BLOCK_GROUP, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    for start in range(split_start, split_end, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        token_mask = tokens < split_end
        # Table entries past the request's blocks may be garbage: masked tokens never read them.
        block_ids = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        # token_offsets: [BLOCK_N], element offset of each token's row for this kv head
        token_offsets = (block_ids * cache_stride_block + (tokens % BLOCK_SIZE) * cache_stride_token
                         + kv_head * HEAD_DIM)
        # k: [HEAD_DIM, BLOCK_N], loaded transposed for q @ k
        k = tl.load(k_cache_ptr + token_offsets[None, :] + dims[:, None], mask=token_mask[None, :], other=0.0)
        scores = tl.dot(q, k.to(COMPUTE), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_GROUP, BLOCK_N]
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        # Every tile holds at least one key, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # v: [BLOCK_N, HEAD_DIM]
        v = tl.load(v_cache_ptr + token_offsets[:, None] + dims[None, :], mask=token_mask[:, None], other=0.0)
        if V_ASM_UPCAST:
            v = e4m3_to_f16_in_registers(v)
        else:
            v = v.to(COMPUTE)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if KV_FP8:
        acc = acc * v_scale
    if WRITE_OUT:
        # l_i == 0 only for a padding request with seq_len 0: give zeros, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=group_mask[:, None])
    else:
        rows = (seq.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        tl.store(partial_max_ptr + rows, m_i, mask=group_mask)
        tl.store(partial_sum_ptr + rows, l_i, mask=group_mask)
        tl.store(partial_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=group_mask[:, None])


@jit_unspecialized("num_splits")
def _decode_reduce_kernel(
    partial_max_ptr,            # [num_seqs, num_heads, num_splits] fp32
    partial_sum_ptr,            # [num_seqs, num_heads, num_splits] fp32
    partial_acc_ptr,            # [num_seqs, num_heads, num_splits, head_dim] fp32
    out_ptr,                    # [num_seqs, num_heads, head_dim]
    num_splits,
    out_stride_seq, out_stride_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,  # next power of two >= num_splits
    OVERLAP: tl.constexpr,
):
    wait_for_prior_kernel(OVERLAP)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)
    rows = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + splits
    maxes = tl.load(partial_max_ptr + rows, mask=split_mask, other=float("-inf"))  # [BLOCK_SPLITS]
    sums = tl.load(partial_sum_ptr + rows, mask=split_mask, other=0.0)
    acc = tl.load(partial_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_mask[:, None], other=0.0)  # [BLOCK_SPLITS, HEAD_DIM]
    m_max = tl.max(maxes, 0)
    # All splits empty (padding request with seq_len 0): avoid -inf - -inf = NaN, output zeros.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weights = tl.exp2(maxes - m_max)  # empty splits: exp2(-inf) = 0
    total = tl.sum(sums * weights, 0)
    out = tl.sum(acc * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * out_stride_seq + head * out_stride_head + dims, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _has_e4m3_cvt(device: torch.device) -> bool:
    return not INTERPRETED and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _shared_memory_per_program(device: torch.device | None) -> int:
    """The most shared memory one program may take: the device's opt-in limit; Hopper's (227 KiB) off a GPU."""
    if device is None or device.type != "cuda" or INTERPRETED:
        return 227 * 1024
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split kernel."""

    block_n: int      # keys per tile
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # a cap per thread that lets one more program share an SM

    def launch_options(self) -> dict:
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.max_registers is not None and not INTERPRETED:
            options["maxnreg"] = self.max_registers
        return options


def default_decode_config(head_dim: int, cache_dtype: torch.dtype, device: torch.device | None = None) -> DecodeConfig:
    """Key tiles of ~16 KiB of K (and as much V), four in flight: ~128 KiB of shared memory, one program per
    Hopper SM (228 KiB) with its loads far enough ahead to cover the paged lookups (the H200 sweep in
    docs/benchmarks.md: a quarter faster than three stages for one long request, the same at 256 requests).
    An fp8 cache's rows are half as long, so its tiles hold twice the keys (128), and six stages give each K/V
    tile a second buffer: the next tile loads while this one is converted and multiplied (~105 KiB of shared
    memory: a GPU with less a program, as sm_89's 99 KiB, keeps four stages, one buffer)."""
    row_bytes = head_dim * cache_dtype.itemsize
    if cache_dtype.itemsize == 1:
        stages = 6 if _shared_memory_per_program(device) >= 160 * 1024 else 4
        return DecodeConfig(block_n=min(128, max(16, 16384 // row_bytes)), num_warps=4, num_stages=stages)
    return DecodeConfig(block_n=min(64, max(16, 16384 // row_bytes)), num_warps=4, num_stages=4)


# a plan of at least this many splits comes from a step of a few requests (up to 16 with 8 KV heads, 132 SMs)
FEW_REQUEST_SPLITS = 8


def few_request_config(config: DecodeConfig, num_splits: int, cache_dtype: torch.dtype) -> DecodeConfig:
    """A 16-bit cache's default tiles for a plan of many splits (a step of a few requests): two pipeline stages
    instead of four. Each program then walks a few tiles, where deeper prefetching only delays its start; one
    long request's sweep found two stages as fast as four (docs/benchmarks.md, 2026-12-07)."""
    if num_splits >= FEW_REQUEST_SPLITS and cache_dtype.itemsize == 2 and config.num_stages > 2:
        return dataclasses.replace(config, num_stages=2)
    return config


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Enough (request, kv head, split) programs for many waves over the SMs, splits >= one tile
    and >= MIN_TOKENS_PER_SPLIT keys.

    Depends on python ints only, so a CUDA graph captured for a batch size and a max_seq_len bound
    replays with the same grid.
    """
    programs = max(1, num_seqs * num_kv_heads)
    # rounded, not ceiled: 256 requests x 4 KV heads (a tensor-parallel rank of Qwen3-8B) are 0.97 of the aim on
    # an H200, where a second split would add a reduce pass for a few percent more programs
    wanted = round(PROGRAMS_PER_SM * num_sms / programs)
    useful = triton.cdiv(max(1, max_seq_len), max(block_n, MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, useful, MAX_SPLITS))


def plan_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device,
                num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, tokens_per_split) that decode_attention launches with; tokens_per_split is a multiple
    of block_n, and num_splits may come out below the one asked for once rounded."""
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, block_n, num_sms(device))
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    max_seq_len = max(1, max_seq_len)
    tokens_per_split = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    return triton.cdiv(max_seq_len, tokens_per_split), tokens_per_split


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_seq_len: int, *, out: torch.Tensor | None = None,
                     num_splits: int | None = None, config: DecodeConfig | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """Attention of one query token per request over its first seq_lens[i] cached keys.

    q: [num_seqs, num_heads, head_dim] (any seq/head strides, unit stride on head_dim)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, q's dtype or fp8 (e4m3)
    holding K / k_scale and V / v_scale (attention/kv_fp8.py)
    block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (the query token's key is
    already in the cache, so seq_lens counts it)
    max_seq_len: a python int, the longest seq_lens[i] expected; sets the number of splits. Each request
    divides its own keys among them, so every key is read whatever max_seq_len says.
    out: optional [num_seqs, num_heads, head_dim] destination (may be a view into a larger tensor).
    Returns out (softmax in fp32, stored in q's dtype). A request with seq_len 0 gets zeros.

    CUDA graphs: no host sync, and the grid and the scratch sizes depend only on shapes and python
    ints (num_seqs, heads, max_seq_len, num_splits); to replay one graph over many steps, capture it
    with max_seq_len set to the largest length the graph will serve (e.g. max_model_len).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
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
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert q.device == k_cache.device == block_tables.device == seq_lens.device
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_seqs == 0:
        return out

    default = config is None
    config = config or default_decode_config(head_dim, k_cache.dtype, q.device)
    asked_splits = num_splits
    num_splits, _ = plan_splits(num_seqs, num_kv_heads, max_seq_len, config.block_n, q.device, num_splits)
    if default:
        config = few_request_config(config, num_splits, k_cache.dtype)
    # a split count asked for by the caller is honoured down to one tile a split; the planned one keeps splits
    # long enough to be worth their partials
    min_tokens_per_split = config.block_n if asked_splits else triton.cdiv(MIN_TOKENS_PER_SPLIT,
                                                                           config.block_n) * config.block_n

    group = num_heads // num_kv_heads
    if num_splits == 1:
        partial_max = partial_sum = partial_acc = out  # unused by the WRITE_OUT variant
    else:
        partial_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
        partial_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                                  device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, partial_max, partial_sum, partial_acc,
        scale * LOG2E * k_scale, v_scale, min_tokens_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=config.block_n, WRITE_OUT=num_splits == 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=kv_fp8,
        V_ASM_UPCAST=kv_fp8 and _has_e4m3_cvt(q.device) and kv_compute_dtype(q.dtype, kv_fp8) == tl.float16,
        COMPUTE=kv_compute_dtype(q.dtype, kv_fp8), **config.launch_options(), **overlap_options(q.device),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial_max, partial_sum, partial_acc, out, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            num_warps=4, **overlap_options(q.device),
        )
    return out
