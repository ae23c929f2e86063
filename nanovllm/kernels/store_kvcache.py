"""Write a step's new keys and values into the paged KV cache, one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import to_e4m3


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr,            # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,      # [num_blocks * block_size, num_kv_heads, head_dim] (contiguous)
    slot_mapping_ptr,              # [num_tokens] int64, -1 = skip
    key_stride_token, key_stride_head,
    value_stride_token, value_stride_head,
    k_inv_scale, v_inv_scale,      # an fp8 cache stores K * k_inv_scale, V * v_inv_scale; read only when FP8
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,         # next power of two >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,         # next power of two >= HEAD_DIM
    FP8: tl.constexpr,             # the cache is e4m3 (kernels/fp8.py)
):
    token = tl.program_id(0)
    # int64: slot * (num_kv_heads * head_dim) can pass 2**31 in a large cache.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding token, or one whose K/V is already cached
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    key = tl.load(key_ptr + token * key_stride_token + heads[:, None] * key_stride_head + dims[None, :],
                  mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + heads[:, None] * value_stride_head + dims[None, :],
                    mask=mask)
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    if FP8:
        key = to_e4m3(key.to(tl.float32), k_inv_scale)
        value = to_e4m3(value.to(tl.float32), v_inv_scale)
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Copy each token's K/V into cache slot ``slot_mapping[token]``; tokens with slot -1 are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim], any token/head strides, unit stride on head_dim
    (e.g. views into a fused qkv projection); cast to the cache dtype on store.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset.
    k_scale, v_scale: an fp8 (e4m3) cache stores K / k_scale and V / v_scale (attention/kv_fp8.py).
    No host sync and no allocation: safe inside a CUDA graph.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"k_cache {tuple(k_cache.shape)} does not hold [*, *, {num_kv_heads}, {head_dim}]"
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be the contiguous dimension"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64, \
        f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
    assert key.device == k_cache.device == slot_mapping.device
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert fp8 or k_scale == v_scale == 1.0, f"scales {k_scale}, {v_scale} given for a {k_cache.dtype} cache"
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), 1.0 / k_scale, 1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
