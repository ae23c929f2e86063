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


def test_tp2_samples_on_vocabulary_slices_with_tp1_tokens(monkeypatch):
    """Temperature sampling at TP=2: each rank draws on its half of the vocabulary, and the tokens equal TP=1's
    (same engine seed, seeded and unseeded requests); a step with top-k falls back to gathering the logits."""
    monkeypatch.setenv("NANOVLLM_NO_COMPILE", "1")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 10000, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 300, (24,), generator=g)]
    sampled = [SamplingParams(temperature=[0.0, 0.7, 1.0][i % 3], seed=i if i % 4 == 0 else None, max_tokens=20,
                              ignore_eos=True) for i in range(24)]
    top_k = [SamplingParams(temperature=0.8, top_k=40, max_tokens=8, ignore_eos=True)] * 4
    kwargs = dict(load_format="dummy", dtype="float32", max_model_len=1024, max_num_seqs=32,
                  kvcache_block_size=16, num_kvcache_blocks=2048, seed=5)

    def run(llm):
        return ([o.token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)],
                [o.token_ids for o in llm.generate(prompts[:4], top_k, use_tqdm=False)])

    single = LLM(FOLDER, enforce_eager=True, **kwargs)
    expected = run(single)
    del single
    torch.cuda.empty_cache()
    assert len({t for tokens in expected[0] for t in tokens}) > 100, "sampling must spread the tokens"
    llm = LLM(FOLDER, tensor_parallel_size=2, **kwargs)
    try:
        decided = []
        choose = llm.runner._slice_sampling
        llm.runner._slice_sampling = lambda seqs, after: decided.append(choose(seqs, after)) or decided[-1]
        assert run(llm) == expected
        assert sum(d is not None for d in decided) >= 20, "every step of the first call samples on the slices"
        assert any(d is None for d in decided), "the top-k steps gather the logits"
    finally:
        llm.close()
