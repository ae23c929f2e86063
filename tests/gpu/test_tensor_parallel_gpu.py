"""Tensor parallelism over NCCL: TP=2 greedy tokens equal TP=1 on the Qwen3-0.6B shape (dummy weights)."""

import os

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

FOLDER = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "model_configs", "qwen3-0.6b")


@pytest.mark.parametrize("custom_all_reduce", [True, False], ids=["peer-to-peer", "nccl-only"])
def test_tp2_equals_tp1_qwen3_shape(monkeypatch, custom_all_reduce):
    # eager elementwise ops: each process would otherwise compile them first (minutes in all for two engines and
    # a worker); the TP=2 engine still captures its CUDA graphs, with its all-reduces inside
    monkeypatch.setenv("NANOVLLM_NO_COMPILE", "1")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 10000, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 600, (32,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # float32 so that the two summation orders of the all-reduce cannot flip a greedy choice
    # an explicit pool: sizing it from free memory would count what earlier engines in this process hold
    kwargs = dict(load_format="dummy", dtype="float32", max_model_len=1024, max_num_seqs=32,
                  kvcache_block_size=16, num_kvcache_blocks=2048, seed=3)
    single = LLM(FOLDER, enforce_eager=True, **kwargs)
    expected = [o.token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    del single
    torch.cuda.empty_cache()
    llm = LLM(FOLDER, tensor_parallel_size=2, disable_custom_all_reduce=not custom_all_reduce, **kwargs)
    try:
        # decode steps all-reduce peer to peer unless disabled
        assert (llm.runner.runner.custom_all_reduce is not None) == custom_all_reduce
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        llm.close()
