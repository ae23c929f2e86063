"""The fused q/k norm + RoPE + KV store kernel against the unfused torch ops it replaces."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from nanovllm.layers.norm import rms_norm
from nanovllm.layers.rotary import RotaryEmbedding, _rotate

pytest.importorskip("triton")

from nanovllm.kernels.rope_store import norm_rope_store  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402


def reference(qkv, positions, rotary, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim):
    """(q, k, v) as the model computes them unfused, in float32."""
    q, k, v = qkv.float().split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q, k = q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = rms_norm(q, q_weight.float(), eps), rms_norm(k, k_weight.float(), eps)
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.view(-1, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, norm", [
    (4, 2, 16, True),   # Qwen3: q/k norm, GQA 2
    (7, 1, 32, False),  # Llama/Qwen2: no q/k norm, heads not a power of two
    (16, 8, 128, True),  # Qwen3-0.6B's heads
])
def test_matches_the_unfused_ops(dtype, num_heads, num_kv_heads, head_dim, norm):
    g = torch.Generator().manual_seed(head_dim + num_heads)
    num_tokens, block_size, num_blocks = 9, 4, 6
    rotary = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), head_dim, max_position=64).to(DEVICE)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # qkv as a view with a padded row stride, as a projection output may be
    qkv = torch.randn(num_tokens, width + 8, generator=g).to(dtype).to(DEVICE)[:, :width]
    positions = torch.randint(0, 64, (num_tokens,), generator=g).to(DEVICE)
    q_weight = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(DEVICE) if norm else None
    k_weight = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(DEVICE) if norm else None
    # distinct slots in shuffled order; two tokens are not stored (slot -1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 6]] = -1
    slots = slots.to(DEVICE)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))

    q = norm_rope_store(qkv, positions, rotary.cos, rotary.sin, q_weight, k_weight, 1e-6, k_cache, v_cache,
                        slots, num_heads, num_kv_heads)

    q_ref, k_ref, v_ref = reference(qkv, positions, rotary, q_weight, k_weight, 1e-6,
                                    num_heads, num_kv_heads, head_dim)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert q.shape == (num_tokens, num_heads, head_dim) and q.dtype == dtype
    torch.testing.assert_close(q.float(), q_ref, **tolerance)
    stored = slots >= 0
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots[stored]].float(), k_ref[stored], **tolerance)
    assert torch.equal(flat_v[slots[stored]], v_ref[stored].to(dtype)), "v is copied unchanged"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[stored]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all(), "only the given slots are written"
