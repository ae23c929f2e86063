"""store_kvcache against store_kvcache_ref: exact copies, skipped slots, strided inputs, dtype casts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.attention.reference import store_kvcache_ref  # noqa: E402
from nanovllm.kernels.store_kvcache import store_kvcache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    return k_cache, torch.randn_like(k_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (3, 80, 32), (8, 128, 256)])
def test_matches_reference(dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    torch.manual_seed(0)
    num_blocks, num_tokens = 6, 37
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens].to(DEVICE)
    slot_mapping[[0, 5, 36]] = -1  # skipped tokens (padding, or K/V already cached)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    v = torch.randn_like(k)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(k, v, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_strided_views_of_fused_qkv_and_cast() -> None:
    """K and V sliced out of a fused projection (token stride > heads * head_dim), stored as fp16."""
    torch.manual_seed(1)
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 32
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    k_cache, v_cache = _caches(3, 16, num_kv_heads, head_dim, torch.float16)
    slot_mapping = torch.tensor([47, 0, 16, 17, 3, -1, 30, 31, 8], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(k, v, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_no_tokens_is_a_no_op() -> None:
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32)
    before = k_cache.clone()
    empty = torch.empty(0, 2, 64, device=DEVICE)
    store_kvcache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before)


def test_rejects_int32_slot_mapping() -> None:
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32)
    k = torch.randn(3, 2, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="int64"):
        store_kvcache(k, k, k_cache, v_cache, torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
def test_gpu_cache_past_int32_offsets() -> None:
    """Qwen3-0.6B KV heads in a pool past 2**31 elements per cache: offsets of high slots need int64."""
    torch.manual_seed(2)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 8448, 256, 8, 128, 8192
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    num_slots = num_blocks * block_size
    slot_mapping = torch.randperm(num_slots // 2, device=DEVICE)[:num_tokens] + num_slots // 2
    slot_mapping[-1] = num_slots - 1
    slot_mapping[::7] = -1
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(k, v, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
