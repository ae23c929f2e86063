"""The fp8 (e4m3) KV cache in the Triton kernels: stores give the torch format's exact bytes, attention over an
fp8 cache matches the torch reference reading the same cache, and a bf16 cache's launch is untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.attention.kv_fp8 import FP8_DTYPE, FP8_MAX, to_cache  # noqa: E402
from nanovllm.attention.reference import (  # noqa: E402
    decode_attention_ref,
    prefill_attention_ref,
    store_kvcache_ref,
)
from nanovllm.kernels.decode_attention import decode_attention, default_decode_config  # noqa: E402
from nanovllm.kernels.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402
from nanovllm.kernels.rope_store import norm_rope_store  # noqa: E402
from nanovllm.kernels.store_kvcache import store_kvcache  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

K_SCALE, V_SCALE = 0.037, 0.0021  # V far smaller than K, as in a model's first layer
# against a reference reading the same fp8 cache: only float32 summation order differs
FP8_READ_TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _fp8_batch(paged_batch, query_lens, context_lens, dtype, **shape):
    """A paged batch whose caches are converted to fp8 (NaN blocks stay NaN) with K_SCALE, V_SCALE."""
    batch = paged_batch(query_lens, context_lens, dtype=dtype, **shape)
    batch.k = batch.k * K_SCALE * 50  # values that use the format's range, some of them saturating
    batch.v = batch.v * V_SCALE * 50
    batch.k_cache = to_cache(batch.k_cache * K_SCALE * 50, FP8_DTYPE, K_SCALE)
    batch.v_cache = to_cache(batch.v_cache * V_SCALE * 50, FP8_DTYPE, V_SCALE)
    store_kvcache_ref(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.slot_mapping, K_SCALE, V_SCALE)
    return batch


def test_store_gives_the_torch_formats_bytes() -> None:
    g = torch.Generator().manual_seed(0)
    num_tokens, heads, head_dim = 37, 2, 64
    # magnitudes from subnormal to past the saturation point, both signs
    k = (torch.randn(num_tokens, heads, head_dim, generator=g) * torch.logspace(-6, 3, head_dim)).to(DEVICE)
    v = (torch.randn(num_tokens, heads, head_dim, generator=g) * torch.logspace(-7, 1, head_dim)).to(DEVICE)
    slots = torch.randperm(64, generator=g)[:num_tokens].to(DEVICE)
    slots[[3, 11]] = -1
    caches = [torch.zeros(8, 8, heads, head_dim, dtype=FP8_DTYPE, device=DEVICE) for _ in range(4)]
    store_kvcache(k, v, caches[0], caches[1], slots, K_SCALE, V_SCALE)
    store_kvcache_ref(k, v, caches[2], caches[3], slots, K_SCALE, V_SCALE)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[0].float().abs().max() == FP8_MAX  # the largest keys saturate
    stored = caches[0].view(-1, heads, head_dim)[slots[0]].float() * K_SCALE
    torch.testing.assert_close(stored, k[0].clamp(-FP8_MAX * K_SCALE, FP8_MAX * K_SCALE), rtol=2 ** -4, atol=1e-4)


def test_rope_store_gives_the_torch_formats_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 32
    rotary = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), head_dim, max_position=64).to(DEVICE)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3).to(DEVICE)
    positions = torch.randint(0, 64, (num_tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(24, generator=g)[:num_tokens].to(DEVICE)
    fp8 = [torch.zeros(6, 4, num_kv_heads, head_dim, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    exact = [torch.zeros(6, 4, num_kv_heads, head_dim, device=DEVICE) for _ in range(2)]
    norm_rope_store(qkv, positions, rotary.cos, rotary.sin, None, None, 0.0, *fp8, slots, num_heads, num_kv_heads,
                    K_SCALE, V_SCALE)
    norm_rope_store(qkv, positions, rotary.cos, rotary.sin, None, None, 0.0, *exact, slots, num_heads,
                    num_kv_heads)
    # the float32 cache's values, put into fp8 by torch: the same bytes
    assert torch.equal(fp8[0].view(torch.uint8), to_cache(exact[0], FP8_DTYPE, K_SCALE).view(torch.uint8))
    assert torch.equal(fp8[1].view(torch.uint8), to_cache(exact[1], FP8_DTYPE, V_SCALE).view(torch.uint8))


# 16-bit queries multiply in float16 over an fp8 cache, which the interpreter's tl.dot does right too
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(4, 2, 64, 16), (8, 1, 128, 32)])
def test_decode_reads_an_fp8_cache(paged_batch, dtype, num_splits, num_heads, num_kv_heads, head_dim,
                                   block_size) -> None:
    seq_lens = [1, 32, 77, 300]
    batch = _fp8_batch(paged_batch, [1] * 4, [n - 1 for n in seq_lens], dtype, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    out = decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125,
                           batch.max_seq_len, num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125,
                               K_SCALE, V_SCALE)
    assert out.dtype == dtype and ref.abs().max() > 10 * V_SCALE  # the output carries V's scale
    torch.testing.assert_close(out, ref, **FP8_READ_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(4, 2, 64, 16), (8, 2, 64, 32)])
@pytest.mark.parametrize("config", [None, PrefillConfig(16, 16, 4, 2, tma=True)], ids=["default", "tma"])
def test_prefill_reads_an_fp8_cache(paged_batch, dtype, num_heads, num_kv_heads, head_dim, block_size,
                                    config) -> None:
    batch = _fp8_batch(paged_batch, [5, 40, 1, 70], [0, 17, 64, 3], dtype, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    out = prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.cu_seqlens_q,
                            batch.seq_lens, 0.125, max(batch.query_lens), config=config, k_scale=K_SCALE,
                            v_scale=V_SCALE)
    ref = prefill_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.cu_seqlens_q,
                                batch.seq_lens, 0.125, K_SCALE, V_SCALE)
    assert out.dtype == dtype and ref.abs().max() > 10 * V_SCALE
    torch.testing.assert_close(out, ref, **FP8_READ_TOLERANCE[dtype])


def test_an_fp8_cache_takes_tiles_of_twice_the_keys() -> None:
    """Its rows are half as long: the same bytes a tile as a 16-bit cache's 64 keys."""
    assert default_decode_config(128, FP8_DTYPE).block_n == 128
    assert default_decode_config(128, torch.bfloat16).block_n == 64


def test_an_fp8_cache_double_buffers_where_shared_memory_allows(monkeypatch) -> None:
    """Six stages (a second K/V buffer, ~105 KiB) on Hopper's 227 KiB a program; four where a program gets less."""
    import nanovllm.kernels.decode_attention as decode

    assert default_decode_config(128, FP8_DTYPE).num_stages == 6
    monkeypatch.setattr(decode, "_shared_memory_per_program", lambda device: 99 * 1024)  # sm_89
    assert default_decode_config(128, FP8_DTYPE).num_stages == 4
    assert default_decode_config(128, torch.bfloat16).num_stages == 4


def test_scales_on_a_16_bit_cache_are_refused(paged_batch) -> None:
    batch = paged_batch([1], [9], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    with pytest.raises(AssertionError, match="scales"):
        decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125, 10,
                         k_scale=0.5)
