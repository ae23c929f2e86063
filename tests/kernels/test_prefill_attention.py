"""prefill_attention against prefill_attention_ref: varlen causal chunks over cached context, GQA, blocks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.attention.reference import prefill_attention_ref  # noqa: E402
from nanovllm.kernels.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (num_heads, num_kv_heads, head_dim, block_size, dtype): GQA ratios 1, 2, 7, 8; blocks smaller than a
# key tile and larger; fp32 tiles (64 x 32 at head_dim 128) and 16-bit tiles (128 x 64).
CASES = [
    (2, 2, 64, 16, torch.float32),
    (4, 2, 64, 32, torch.float16),
    (7, 1, 64, 16, torch.float16),
    (8, 1, 128, 128, torch.float32),
    (8, 1, 128, 16, torch.float16),
]
# (query_len, context_len): a one-token prompt; a one-token chunk after a context; a context ending
# exactly on a block boundary; a plain prompt; a chunk longer than a query tile after a boundary
# context; a ragged chunk after a ragged context.
REQUESTS = [(1, 0), (1, 37), (5, 32), (70, 0), (130, 64), (33, 100)]


def _run(batch, scale: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    out = prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.cu_seqlens_q,
                            batch.seq_lens, scale, max(batch.query_lens), **kwargs)
    ref = prefill_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.cu_seqlens_q,
                                batch.seq_lens, scale)
    return out, ref


def _batch(paged_batch, requests, **kwargs):
    return paged_batch([q for q, _ in requests], [c for _, c in requests], **kwargs)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", CASES)
def test_matches_reference(paged_batch, tolerances, num_heads, num_kv_heads, head_dim, block_size, dtype) -> None:
    batch = _batch(paged_batch, REQUESTS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=block_size, dtype=dtype)
    out, ref = _run(batch, head_dim**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tolerances[dtype])


@pytest.mark.parametrize("config", [PrefillConfig(16, 16, 4, 2), PrefillConfig(32, 128, 4, 2),
                                    PrefillConfig(64, 16, 4, 2), PrefillConfig(16, 32, 4, 2, heads=2)])
def test_other_tilings(paged_batch, tolerances, config) -> None:
    """Query tiles smaller and larger than key tiles: the unmasked/masked split of the key range moves; both
    query heads of a KV head in one program."""
    batch = _batch(paged_batch, [(1, 0), (17, 15), (50, 47), (9, 130)], num_heads=4, num_kv_heads=2,
                   head_dim=32, block_size=16, dtype=torch.float32)
    out, ref = _run(batch, 0.2, config=config)
    torch.testing.assert_close(out, ref, **tolerances[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [PrefillConfig(16, 16, 4, 2, tma=True), PrefillConfig(16, 32, 4, 2, heads=2, tma=True),
                                    PrefillConfig(32, 16, 4, 2, tma=True)])
def test_tiles_copied_by_descriptor(paged_batch, tolerances, dtype, config) -> None:
    """K/V tiles copied whole by tensor descriptors (what a Hopper GPU does where a cache block holds whole tiles).
    The slots past each request's end in its last block are NaN: a tile copies them, and none may reach the output."""
    block_size = 32
    batch = _batch(paged_batch, [(1, 0), (5, 32), (40, 0), (33, 100), (17, 15), (9, 130)], num_heads=4,
                   num_kv_heads=2, head_dim=32, block_size=block_size, dtype=dtype)
    for row, seq_len in zip(batch.block_tables.tolist(), batch.seq_lens.tolist(), strict=True):
        last_block = row[(seq_len - 1) // block_size]
        for cache in (batch.k_cache, batch.v_cache):
            cache[last_block, seq_len % block_size or block_size:] = float("nan")
    out, ref = _run(batch, 0.2, config=config)
    torch.testing.assert_close(out, ref, **tolerances[dtype])


def test_descriptor_tiles_need_blocks_of_whole_tiles(paged_batch) -> None:
    batch = _batch(paged_batch, [(3, 0)], num_heads=2, num_kv_heads=1, head_dim=32, block_size=16,
                   dtype=torch.float32)
    with pytest.raises(AssertionError, match="multiple"):
        _run(batch, 0.1, config=PrefillConfig(16, 32, 4, 2, tma=True))


def test_strided_q_and_out_view(paged_batch, tolerances) -> None:
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    batch = _batch(paged_batch, [(3, 20), (40, 0)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, block_size=16, dtype=torch.float16)
    qkv = torch.randn(43, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).half()
    batch.q = qkv[:, : num_heads * head_dim].view(43, num_heads, head_dim)
    buffer = torch.zeros(45, num_heads, head_dim, device=DEVICE, dtype=torch.float16)
    out, ref = _run(batch, 0.125, out=buffer[2:])
    assert out.data_ptr() == buffer[2:].data_ptr()
    torch.testing.assert_close(buffer[2:], ref, **tolerances[torch.float16])
    assert not buffer[:2].any()


def test_rejects_head_dim_not_power_of_two(paged_batch) -> None:
    batch = _batch(paged_batch, [(3, 0)], num_heads=2, num_kv_heads=1, head_dim=96, block_size=16,
                   dtype=torch.float32)
    with pytest.raises(AssertionError, match="power of two"):
        _run(batch, 0.1)


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes (Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128), bf16.

QWEN3_06B = dict(num_heads=16, num_kv_heads=8, head_dim=128)


def _random_requests(n: int, max_query: int, max_context: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randint(1, max_query + 1, (n,), generator=gen).tolist()
    contexts = torch.randint(0, max_context + 1, (n,), generator=gen).tolist()
    return list(zip(queries, contexts, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_requests,max_query,max_context", [(8, 2048, 0), (16, 512, 3000), (64, 64, 2048)])
def test_gpu_qwen3_bf16(paged_batch, tolerances, block_size, num_requests, max_query, max_context) -> None:
    requests = _random_requests(num_requests, max_query, max_context, seed=num_requests)
    requests[0] = (1, 0)
    requests[-1] = (max_query, (max_context // block_size) * block_size)  # context ends on a block boundary
    batch = _batch(paged_batch, requests, block_size=block_size, dtype=torch.bfloat16, **QWEN3_06B)
    out, ref = _run(batch, 128**-0.5)
    torch.testing.assert_close(out, ref, **tolerances[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(28, 4, 64), (32, 32, 128), (16, 2, 128), (8, 4, 256)])
def test_gpu_groups_and_dtypes(paged_batch, tolerances, dtype, num_heads, num_kv_heads, head_dim) -> None:
    requests = _random_requests(12, 700, 1500, seed=num_heads)
    batch = _batch(paged_batch, requests, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=32, dtype=dtype)
    out, ref = _run(batch, head_dim**-0.5)
    torch.testing.assert_close(out, ref, **tolerances[dtype])


@pytest.mark.gpu
def test_gpu_block_ids_past_int32_offsets(paged_batch, tolerances) -> None:
    """A pool past 2**31 elements per cache: offsets of high blocks need int64 arithmetic."""
    batch = _batch(paged_batch, [(300, 4000), (20, 0), (513, 1536)], block_size=256, dtype=torch.bfloat16,
                   pool_blocks=8448, **QWEN3_06B)
    assert int(batch.block_tables.max()) * 256 * 8 * 128 >= 2**31  # past int32
    out, ref = _run(batch, 128**-0.5)
    torch.testing.assert_close(out, ref, **tolerances[torch.bfloat16])


def test_default_config_by_copy_path(monkeypatch) -> None:
    """Gathered 32 KiB tiles where descriptors do not apply; 16 KiB tiles, three stages and two heads a program
    (one for an odd GQA group) where they do."""
    from nanovllm.kernels import prefill_attention as module

    cpu = torch.device("cpu")
    gathered = module.default_prefill_config(128, torch.bfloat16, 2, 256, cpu)
    assert (gathered.block_m, gathered.block_n, gathered.num_warps, gathered.num_stages, gathered.heads,
            gathered.tma) == (128, 128, 8, 2, 1, False)
    monkeypatch.setattr(module, "uses_tma", lambda config, block_size, device: block_size % config.block_n == 0)
    copied = module.default_prefill_config(128, torch.bfloat16, 2, 256, cpu)
    assert (copied.block_m, copied.block_n, copied.num_warps, copied.num_stages, copied.heads) == (64, 64, 4, 3, 2)
    assert module.default_prefill_config(128, torch.bfloat16, 7, 256, cpu).heads == 1
    assert module.default_prefill_config(256, torch.bfloat16, 4, 256, cpu).block_n == 32  # 512-byte rows
    assert module.default_prefill_config(128, torch.bfloat16, 2, 16, cpu).tma is False  # blocks under a tile
