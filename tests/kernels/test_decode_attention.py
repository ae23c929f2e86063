"""decode_attention (split-K) against decode_attention_ref: GQA groups, block sizes, splits, padding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.attention.reference import decode_attention_ref  # noqa: E402
from nanovllm.kernels.decode_attention import (  # noqa: E402
    choose_num_splits,
    decode_attention,
    default_decode_config,
    few_request_config,
    plan_splits,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (num_heads, num_kv_heads, head_dim, block_size, dtype): GQA ratios 1, 2, 7 (padded), 8; blocks smaller
# than a key tile (16, 32) and larger (128); fp32 tiles of 32 keys, fp16 tiles of 64.
CASES = [
    (2, 2, 64, 16, torch.float32),
    (4, 2, 64, 32, torch.float16),
    (7, 1, 64, 16, torch.float32),
    (16, 2, 128, 128, torch.float16),
    (8, 1, 128, 16, torch.float32),
]
# One-token request, a request ending exactly on a block boundary (16 and 32), ragged ones.
SEQ_LENS = [1, 32, 77, 300]


def _run(batch, scale: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    out = decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale,
                           kwargs.pop("max_seq_len", batch.max_seq_len), **kwargs)
    ref = decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    return out, ref


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", CASES)
def test_matches_reference(paged_batch, tolerances, num_splits, num_heads, num_kv_heads, head_dim, block_size,
                           dtype) -> None:
    batch = paged_batch([1] * len(SEQ_LENS), [n - 1 for n in SEQ_LENS], num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    out, ref = _run(batch, head_dim**-0.5, num_splits=num_splits)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tolerances[dtype])


def test_loose_max_seq_len_bound_leaves_empty_splits(paged_batch, tolerances) -> None:
    """As in a CUDA graph captured for max_model_len: most splits hold no keys and must weigh nothing."""
    batch = paged_batch([1, 1, 1], [0, 40, 150], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                        dtype=torch.float32)
    out, ref = _run(batch, 0.3, max_seq_len=4096)
    assert choose_num_splits(3, 2, 4096, 32, 132) == 64
    torch.testing.assert_close(out, ref, **tolerances[torch.float32])


def test_a_short_bound_still_reads_every_key(paged_batch, tolerances) -> None:
    """Each request splits its own keys: a max_seq_len below a request's length changes the plan, not the
    result (the split count for a 16-key bound, then each split's length from the request's 300 keys)."""
    batch = paged_batch([1, 1], [299, 40], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                        dtype=torch.float32)
    for num_splits in (None, 4):
        out, ref = _run(batch, 0.3, max_seq_len=16, num_splits=num_splits)
        torch.testing.assert_close(out, ref, **tolerances[torch.float32])


def test_strided_q_and_out_view(paged_batch, tolerances) -> None:
    """q sliced from a fused qkv projection; out written into a view of a larger buffer."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    batch = paged_batch([1, 1], [20, 150], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        block_size=16, dtype=torch.float16)
    qkv = torch.randn(2, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).half()
    batch.q = qkv[:, : num_heads * head_dim].view(2, num_heads, head_dim)
    buffer = torch.zeros(5, num_heads, head_dim, device=DEVICE, dtype=torch.float16)
    out, ref = _run(batch, 0.125, out=buffer[1:3], num_splits=2)
    assert out.data_ptr() == buffer[1:3].data_ptr()
    torch.testing.assert_close(buffer[1:3], ref, **tolerances[torch.float16])
    assert not buffer[0].any() and not buffer[3:].any()


@pytest.mark.parametrize("num_splits", [1, 2])
def test_padding_request_with_no_keys_gives_zeros(paged_batch, tolerances, num_splits) -> None:
    """A CUDA graph pads the batch with seq_len-0 requests: they must give finite zeros, not NaN."""
    batch = paged_batch([1, 1], [30, 0], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                        dtype=torch.float32)
    batch.seq_lens[1] = 0
    out = decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.1, 512,
                           num_splits=num_splits)
    ref = decode_attention_ref(batch.q[:1], batch.k_cache, batch.v_cache, batch.block_tables[:1],
                               batch.seq_lens[:1], 0.1)
    torch.testing.assert_close(out[:1], ref, **tolerances[torch.float32])
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_choose_num_splits() -> None:
    assert choose_num_splits(256, 8, 1024, 64, 132) == 1   # 2048 programs already cover the SMs
    assert choose_num_splits(64, 8, 1024, 64, 132) == 2    # 512 programs: splits add waves
    assert choose_num_splits(256, 4, 1024, 64, 132) == 1   # 1024 programs: near enough the aim of 1056
    assert choose_num_splits(1024, 8, 1024, 64, 132) == 1  # enough programs already
    assert choose_num_splits(1, 8, 60, 64, 132) == 1       # too short to split
    assert choose_num_splits(1, 8, 1 << 20, 64, 132) == 64  # capped
    assert choose_num_splits(4, 8, 4096, 64, 132) == 33    # 1056 programs wanted
    assert choose_num_splits(1, 8, 1000, 64, 132) == 16    # 64 keys per split at least
    assert choose_num_splits(1, 8, 1000, 128, 132) == 8    # one tile per split at least


def test_a_few_requests_take_two_pipeline_stages() -> None:
    bf16 = default_decode_config(128, torch.bfloat16)
    assert bf16.num_stages == 4
    assert few_request_config(bf16, 64, torch.bfloat16).num_stages == 2  # one request at any length
    assert few_request_config(bf16, 8, torch.bfloat16).num_stages == 2   # 16 requests x 8 KV heads
    assert few_request_config(bf16, 4, torch.bfloat16) == bf16            # 32 requests and more keep four
    fp8 = default_decode_config(128, torch.float8_e4m3fn)
    assert few_request_config(fp8, 64, torch.float8_e4m3fn) == fp8        # an fp8 cache keeps its own tiles


def test_plan_splits_rounds_to_whole_tiles() -> None:
    cpu = torch.device("cpu")
    assert plan_splits(1, 1, 300, 64, cpu, num_splits=3) == (3, 128)
    assert plan_splits(1, 1, 64, 64, cpu, num_splits=2) == (1, 64)  # one tile cannot be split
    assert plan_splits(1, 1, 1000, 32, cpu, num_splits=7) == (7, 160)
    splits, tokens = plan_splits(2, 8, 40960, 64, cpu)
    assert splits * tokens >= 40960 and tokens % 64 == 0


def test_rejects_head_dim_not_power_of_two(paged_batch) -> None:
    batch = paged_batch([1], [5], num_heads=2, num_kv_heads=1, head_dim=80, block_size=16, dtype=torch.float32)
    with pytest.raises(AssertionError, match="power of two"):
        _run(batch, 0.1)


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes (Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128), bf16.

QWEN3_06B = dict(num_heads=16, num_kv_heads=8, head_dim=128)


def _random_lens(n: int, low: int, high: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("batch_size,max_len", [(64, 4096), (256, 1024), (3, 3000)])
def test_gpu_qwen3_bf16(paged_batch, tolerances, block_size, batch_size, max_len) -> None:
    lens = _random_lens(batch_size, 1, max_len, seed=batch_size)
    lens[0], lens[-1] = 1, max_len
    batch = paged_batch([1] * batch_size, [n - 1 for n in lens], block_size=block_size, dtype=torch.bfloat16,
                        **QWEN3_06B)
    out, ref = _run(batch, 128**-0.5)
    torch.testing.assert_close(out, ref, **tolerances[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(28, 4, 64), (32, 32, 128), (16, 2, 128), (8, 4, 256)])
def test_gpu_groups_and_dtypes(paged_batch, tolerances, dtype, num_heads, num_kv_heads, head_dim) -> None:
    lens = _random_lens(48, 1, 2000, seed=num_heads)
    batch = paged_batch([1] * 48, [n - 1 for n in lens], num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, block_size=32, dtype=dtype)
    for num_splits in (None, 1, 5):
        out, ref = _run(batch, head_dim**-0.5, num_splits=num_splits)
        torch.testing.assert_close(out, ref, **tolerances[dtype])


@pytest.mark.gpu
def test_gpu_block_ids_past_int32_offsets(paged_batch, tolerances) -> None:
    """A pool past 2**31 elements per cache: offsets of high blocks need int64 arithmetic."""
    batch = paged_batch([1] * 4, [4000, 10, 2047, 700], block_size=256, dtype=torch.bfloat16,
                        pool_blocks=8448, **QWEN3_06B)
    assert int(batch.block_tables.max()) * 256 * 8 * 128 >= 2**31  # past int32
    out, ref = _run(batch, 128**-0.5)
    torch.testing.assert_close(out, ref, **tolerances[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(paged_batch, tolerances) -> None:
    """Capture once with a max_seq_len bound, then replay over new lengths and queries written in place."""
    batch_size, bound = 32, 2048
    lens = _random_lens(batch_size, 1, bound, seed=7)
    batch = paged_batch([1] * batch_size, [bound - 1] * batch_size, block_size=16, dtype=torch.bfloat16,
                        **QWEN3_06B)
    scale = 128**-0.5
    out = torch.empty_like(batch.q)
    decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale, bound,
                     out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale, bound,
                         out=out)
    for step in range(3):
        batch.seq_lens.copy_(torch.tensor([max(1, n - 100 * step) for n in lens], dtype=torch.int32))
        batch.q.copy_(torch.randn_like(batch.q))
        graph.replay()
        ref = decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                   scale)
        torch.testing.assert_close(out, ref, **tolerances[torch.bfloat16])
