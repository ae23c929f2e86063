"""One kernel from a fused qkv projection to attention's inputs: q/k RMSNorm, RoPE, and the K/V cache store.

Unfused, these are five small kernels per layer (q norm, k norm, RoPE of q and of k, the store), each a
launch of a few microseconds at decode batch sizes; one program per token does them all here, reading the
token's q, k and v once. Statistics and rotation run in float32 and round once, to the activations' dtype.

Per token, with x1 = x[:D/2], x2 = x[D/2:] (rotate-half RoPE, cos/sin looked up at the token's position)::

    x  = x * rsqrt(mean(x^2) + eps) * weight          (q and k, when the model norms them)
    x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  (q and k)
    q -> q_out;  k, v -> cache slot slot_mapping[token]  (slot -1: not stored)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import to_e4m3
from nanovllm.kernels.jit import jit_unspecialized, overlap_options, wait_for_prior_kernel


@triton.jit
def _rotate_half(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rms_scale(x1, x2, eps, HEAD_DIM: tl.constexpr):
    """1 / rms of each row of [heads, D/2] halves, as a [heads, 1] column."""
    mean_square = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM
    return tl.rsqrt(mean_square + eps)[:, None]


# positions and slots are slices of the step's packed index buffer: their alignment changes with the batch
@jit_unspecialized("positions_ptr", "slot_mapping_ptr")
def _norm_rope_store_kernel(
    qkv_ptr,                    # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], unit stride on the last
    positions_ptr,              # [num_tokens] int64
    cos_ptr, sin_ptr,           # [max_position, head_dim] float32 (the two halves are equal: only [:D/2] is read)
    q_weight_ptr, k_weight_ptr,  # [head_dim]; read only when NORM
    q_out_ptr,                  # [num_tokens, num_heads, head_dim] contiguous
    k_cache_ptr, v_cache_ptr,   # [num_blocks * block_size, num_kv_heads, head_dim] contiguous
    slot_mapping_ptr,           # [num_tokens] int64, -1 = do not store
    qkv_stride_token,
    table_stride,
    eps,
    k_inv_scale, v_inv_scale,   # an fp8 cache stores K * k_inv_scale, V * v_inv_scale; read only when FP8
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,  # next power of two >= NUM_HEADS
    BLOCK_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NORM: tl.constexpr,
    FP8: tl.constexpr,          # the cache is e4m3 (kernels/fp8.py)
    OVERLAP: tl.constexpr,      # launched overlapped with the kernel before (kernels/jit.py)
):
    wait_for_prior_kernel(OVERLAP)
    token = tl.program_id(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, HALF)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * table_stride + half)[None, :]
    sin = tl.load(sin_ptr + position * table_stride + half)[None, :]
    row = qkv_ptr + token.to(tl.int64) * qkv_stride_token

    # q: [BLOCK_HEADS, HALF] halves
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    q_mask = heads < NUM_HEADS
    q1 = tl.load(row + heads * HEAD_DIM + half[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(row + heads * HEAD_DIM + HALF + half[None, :], mask=q_mask, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = _rms_scale(q1, q2, eps, HEAD_DIM)
        q1 = q1 * inv_rms * tl.load(q_weight_ptr + half).to(tl.float32)[None, :]
        q2 = q2 * inv_rms * tl.load(q_weight_ptr + HALF + half).to(tl.float32)[None, :]
    q1, q2 = _rotate_half(q1, q2, cos, sin)
    q_row = q_out_ptr + token.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM
    tl.store(q_row + half[None, :], q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_row + HALF + half[None, :], q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    # int64: slot * (num_kv_heads * head_dim) can pass 2**31 in a large cache
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        kv_heads = tl.arange(0, BLOCK_KV_HEADS)[:, None]
        kv_mask = kv_heads < NUM_KV_HEADS
        k_row = row + NUM_HEADS * HEAD_DIM + kv_heads * HEAD_DIM
        k1 = tl.load(k_row + half[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_row + HALF + half[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        if NORM:
            k_inv_rms = _rms_scale(k1, k2, eps, HEAD_DIM)  # a new name: q's has another shape
            k1 = k1 * k_inv_rms * tl.load(k_weight_ptr + half).to(tl.float32)[None, :]
            k2 = k2 * k_inv_rms * tl.load(k_weight_ptr + HALF + half).to(tl.float32)[None, :]
        k1, k2 = _rotate_half(k1, k2, cos, sin)
        cache_row = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_heads * HEAD_DIM
        if FP8:
            k1, k2 = to_e4m3(k1, k_inv_scale), to_e4m3(k2, k_inv_scale)
        tl.store(k_cache_ptr + cache_row + half[None, :], k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_cache_ptr + cache_row + HALF + half[None, :], k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        dims = tl.arange(0, HEAD_DIM)[None, :]
        v = tl.load(k_row + NUM_KV_HEADS * HEAD_DIM + dims, mask=kv_mask)
        if FP8:
            v = to_e4m3(v.to(tl.float32), v_inv_scale)
        tl.store(v_cache_ptr + cache_row + dims, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    num_heads: int, num_kv_heads: int, k_scale: float = 1.0, v_scale: float = 1.0, *,
                    q_out: torch.Tensor | None = None) -> torch.Tensor:
    """The rotated (and normed) q of each token; its rotated (and normed) k and its v go into the cache.

    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], q then k then v, unit stride on the last dim.
    positions: [num_tokens] int64; cos, sin: [max_position, head_dim] float32 (rotate-half tables).
    q_weight, k_weight: the q/k RMSNorm weights [head_dim], or both None for a model without q/k norm.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous; slot_mapping: [num_tokens]
    int64, -1 = not stored; an fp8 (e4m3) cache stores K / k_scale and V / v_scale (attention/kv_fp8.py).
    Returns q: [num_tokens, num_heads, head_dim] in qkv's dtype, written into q_out (contiguous, that shape and
    dtype) when given.
    No host sync; the only allocation is q (none with q_out): safe inside a CUDA graph.
    """
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1, \
        f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x {num_kv_heads} heads of {head_dim}"
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two"
    assert k_cache.dim() == 4 and k_cache.shape[2] == num_kv_heads and k_cache.is_contiguous()
    assert v_cache.shape == k_cache.shape and v_cache.is_contiguous()
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.stride() == sin.stride() \
        and cos.stride(1) == 1 and cos.dtype == torch.float32, "cos/sin must be float32 [max_position, head_dim]"
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,)
    assert slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"
    assert (q_weight is None) == (k_weight is None), "give both q/k norm weights or neither"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert fp8 or k_scale == v_scale == 1.0, f"scales {k_scale}, {v_scale} given for a {k_cache.dtype} cache"
    if q_out is None:
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    else:
        assert q_out.shape == (num_tokens, num_heads, head_dim) and q_out.dtype == qkv.dtype \
            and q_out.is_contiguous(), f"q_out {tuple(q_out.shape)} {q_out.dtype} is not a contiguous q"
        q = q_out
    if num_tokens == 0:
        return q
    norm = q_weight is not None
    _norm_rope_store_kernel[(num_tokens,)](
        qkv, positions, cos, sin, q_weight if norm else cos, k_weight if norm else cos, q,
        k_cache, v_cache, slot_mapping, qkv.stride(0), cos.stride(0), eps, 1.0 / k_scale, 1.0 / v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, NORM=norm, FP8=fp8,
        num_warps=4 if (num_heads + num_kv_heads) * head_dim >= 2048 else 2, **overlap_options(qkv.device),
    )
    return q
