"""Speculative decoding on CUDA: verify steps replay the decode graphs and keep the CPU's greedy tokens.
Run with `pytest -m gpu`."""

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def prompts():
    g = torch.Generator().manual_seed(3)
    passages = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (20, 60, 250)]
    return [p + p[:len(p) // 2] for p in passages]


def test_gpu_speculation_keeps_the_cpu_tokens_and_replays_graphs(tiny_qwen3):
    cpu = LLM(tiny_qwen3, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256)
    expected = [o.token_ids for o in cpu.generate(prompts(), GREEDY, use_tqdm=False)]
    for eager in (True, False):
        gpu = LLM(tiny_qwen3, device="cuda", dtype="float32", enforce_eager=eager, kvcache_block_size=16,
                  num_kvcache_blocks=256, speculative_config=SPEC)
        replayed = []
        if gpu.runner.graphs is not None:
            original = gpu.runner.graphs.replay
            gpu.runner.graphs.replay = (lambda step, replayed=replayed, original=original:
                                        replayed.append(step.input_ids.shape[0]) or original(step))
        assert [o.token_ids for o in gpu.generate(prompts(), GREEDY, use_tqdm=False)] == expected
        assert [[o.token_ids for o in gpu.generate([p], GREEDY, use_tqdm=False)][0] for p in prompts()] == expected
        assert gpu.scheduler.spec_stats.num_accepted_tokens > 0
        if not eager:
            assert max(replayed) > len(prompts()), "verify steps (several rows a request) replayed a graph"
