"""The engine with the sampling kernel's noise (the CUDA default), here on the CPU under the Triton interpreter:
seeds decide alone, greedy-equivalent settings stay greedy, filters still apply."""

import numpy as np
import pytest

from nanovllm import LLM, SamplingParams

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernel_llm(tiny_text_model):
    llm = LLM(tiny_text_model, kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=256)
    llm.runner.seed_source = np.random.default_rng(0)  # as on CUDA
    return llm


def tokens(outputs):
    return [o.token_ids for o in outputs]


def test_seeded_request_alone_and_in_a_mixed_batch(kernel_llm):
    llm = kernel_llm
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    alone = llm.generate(["hello world and"], seeded, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=5, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    mixed = llm.generate(["the quick brown fox", "hello world and", "café naïve", [5, 6, 7]],
                         [others[0], seeded, others[1], others[2]], use_tqdm=False)
    assert mixed[1].token_ids == alone, "a filtered batch and a plain one draw a seeded row the same way"
    other = SamplingParams(temperature=1.0, seed=43, max_tokens=10, ignore_eos=True)
    assert llm.generate(["hello world and"], other, use_tqdm=False)[0].token_ids != alone


def test_greedy_equivalents_and_top_k(kernel_llm):
    llm = kernel_llm
    prompts = ["the quick brown fox", "hello world and"]
    expected = tokens(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                   use_tqdm=False))
    for params in (SamplingParams(top_k=1, max_tokens=8, ignore_eos=True),
                   SamplingParams(top_p=1e-6, temperature=0.9, max_tokens=8, ignore_eos=True)):
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected, params
    # top_k=3: every sampled token is among the 3 most likely (checked through logprobs of the raw logits)
    out = llm.generate(prompts, SamplingParams(temperature=2.0, top_k=3, logprobs=3, max_tokens=8,
                                               ignore_eos=True, seed=5), use_tqdm=False)
    for o in out:
        for token, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True):
            assert entry[token].rank <= 3
