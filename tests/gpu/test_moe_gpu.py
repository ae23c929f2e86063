"""The tiny Qwen3-MoE on CUDA (fused-MoE Triton kernels, CUDA graphs, asynchronous scheduling) against the
CPU's tokens in float32. Run with `pytest -m gpu`."""

import gc

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (1, 16, 17, 40, 100, 255, 300)]


def test_moe_gpu_float32_greedy_equals_cpu(tiny_qwen3_moe):
    cpu = LLM(tiny_qwen3_moe, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256)
    expected = [o.token_ids for o in cpu.generate(prompts(), GREEDY, use_tqdm=False)]
    for eager in (True, False):
        gpu = LLM(tiny_qwen3_moe, device="cuda", dtype="float32", enforce_eager=eager, kvcache_block_size=16,
                  num_kvcache_blocks=256, max_num_batched_tokens=128)
        assert gpu.runner.graphs is None if eager else gpu.runner.graphs is not None
        assert [o.token_ids for o in gpu.generate(prompts(), GREEDY, use_tqdm=False)] == expected
        assert [o.token_ids for o in gpu.generate(prompts(), GREEDY, use_tqdm=False)] == expected  # prefix hits
        del gpu
        gc.collect()


def test_moe_gpu_preemption_equals_cpu(tiny_qwen3_moe):
    g = torch.Generator().manual_seed(2)
    requests = [torch.randint(3, 380, (14,), generator=g).tolist() for _ in range(12)]
    cpu = LLM(tiny_qwen3_moe, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64)
    expected = [o.token_ids for o in cpu.generate(requests, GREEDY, use_tqdm=False)]
    gpu = LLM(tiny_qwen3_moe, device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=10)
    assert [o.token_ids for o in gpu.generate(requests, GREEDY, use_tqdm=False)] == expected
    assert gpu.scheduler.stats.num_preemptions > 0


def test_qwen3_30b_a3b_shape_runs_with_graphs():
    """The real shape (48 layers, 128 experts, top-8) with dummy weights, bf16, CUDA graphs: it runs and
    every request gets its tokens."""
    import os
    folder = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "model_configs", "qwen3-30b-a3b")
    llm = LLM(folder, load_format="dummy", max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.9)
    out = llm.generate([[1, 2, 3] * 100] * 40, SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [16] * 40
    llm.close()
