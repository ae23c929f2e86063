"""TritonAttentionBackend against TorchAttentionBackend on mixed batches (decodes first, then chunks)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend

triton = pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def _metadata(batch, num_decodes: int) -> AttentionMetadata:
    seq_lens = [q + c for q, c in zip(batch.query_lens, batch.context_lens, strict=True)]
    return AttentionMetadata(
        slot_mapping=batch.slot_mapping, cu_seqlens_q=batch.cu_seqlens_q, seq_lens=batch.seq_lens,
        block_tables=batch.block_tables, num_decodes=num_decodes, num_decode_tokens=num_decodes,
        max_query_len=max(batch.query_lens), max_seq_len=max(seq_lens),
        query_lens_host=list(batch.query_lens), seq_lens_host=seq_lens,
    )


def _check(batch, num_decodes: int, tolerance: dict) -> None:
    meta = _metadata(batch, num_decodes)
    scale = batch.q.shape[-1] ** -0.5
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    out_ref = TorchAttentionBackend().forward(batch.q, batch.k, batch.v, k_ref, v_ref, meta, scale)
    out = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, meta, scale)
    # Unowned blocks are NaN on both sides; every stored slot must match bit for bit.
    torch.testing.assert_close(batch.k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(out, out_ref, **tolerance)


# (query_len, context_len) of each request; decodes (query_len 1) first.
MIXED = [(1, 0), (1, 15), (1, 64), (1, 200), (1, 31), (7, 0), (1, 40), (40, 32), (70, 17)]


FP32_GROUP2 = (4, 2, 64, 16, torch.float32)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,num_decodes", [
    (*FP32_GROUP2, 5),                     # mixed
    (*FP32_GROUP2, 0),                     # prefill chunks only
    (*FP32_GROUP2, 9),                     # decodes only
    (7, 1, 64, 32, torch.float16, 5),      # GQA 7 (padded), block 32
    (8, 1, 128, 16, torch.float16, 5),     # GQA 8, head_dim 128
])
def test_matches_torch_backend(paged_batch, tolerances, num_heads, num_kv_heads, head_dim, block_size, dtype,
                               num_decodes) -> None:
    requests = MIXED if num_decodes != 9 else [(1, c) for _, c in MIXED]
    batch = paged_batch([q for q, _ in requests], [c for _, c in requests], num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                        store_chunk=False)
    _check(batch, num_decodes, tolerances[dtype])


def test_name() -> None:
    assert TritonAttentionBackend.name == "triton"


def test_module_imports_without_triton() -> None:
    """The engine imports the backend module on any machine; triton loads only when it is constructed."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from nanovllm.attention.triton_backend import TritonAttentionBackend\n"
        "try:\n    TritonAttentionBackend()\nexcept ImportError:\n    print('lazy')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "lazy"


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_qwen3_bf16_mixed_batch(paged_batch, tolerances, block_size) -> None:
    gen = torch.Generator().manual_seed(block_size)
    contexts = torch.randint(0, 3000, (64,), generator=gen).tolist()
    requests = [(1, c) for c in contexts] + [(512, 0), (300, 1024), (1, 700), (2000, 2 * block_size)]
    batch = paged_batch([q for q, _ in requests], [c for _, c in requests], num_heads=16, num_kv_heads=8,
                        head_dim=128, block_size=block_size, dtype=torch.bfloat16, store_chunk=False)
    _check(batch, 64, tolerances[torch.bfloat16])


def test_engine_on_the_triton_backend_gives_hf_greedy_tokens(tiny_qwen3):
    """The whole model through the Triton path (fused q/k norm + RoPE + store, prefill and decode kernels,
    chunked prefill, a prefix-cache hit) gives transformers' greedy tokens."""
    from nanovllm import LLM, SamplingParams
    from tests.helpers import hf_greedy

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (1, 17, 40)]
    prompts.append(prompts[2][:32] + [7, 8])  # reuses two full blocks of the third prompt
    reference, _ = hf_greedy(tiny_qwen3, prompts, 4)
    llm = LLM(tiny_qwen3, attention_backend="triton", kvcache_block_size=16, num_kvcache_blocks=64,
              max_num_batched_tokens=32, max_model_len=64)
    assert llm.runner.model.model.layers[0].self_attn.attn.fuses_qkv(llm.runner.model.model.layers[0].self_attn.rotary)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)] == reference[:3]
    assert llm.generate(prompts[3:], params, use_tqdm=False)[0].token_ids == reference[3]
    assert llm.scheduler.block_manager.num_hit_tokens >= 32
