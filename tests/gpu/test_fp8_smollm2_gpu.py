"""fp8 on the GPU, on the embedded SmolLM2: teacher-forced top-1 agreement with bf16 over a fixed passage.

Prints the figures (run with -s); the floors are the CPU torch path's measurements on the same passage
(fp8 KV cache: 92.6 % against a bf16 cache, 1,010 positions), less a margin."""

from __future__ import annotations

import gc

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.models.passage import PASSAGE

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ENGINE = dict(max_model_len=2048, kvcache_block_size=256, num_kvcache_blocks=16, max_num_batched_tokens=256)


def _top1(**options) -> list[int]:
    """The top-1 token after every prefix of the passage (prefilled in chunks of 256: later chunks read the
    cache), from a fresh engine."""
    llm = LLM(**ENGINE, **options)
    ids = llm.tokenizer.encode(PASSAGE)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    top1 = [max(entry, key=lambda t: entry[t].logprob) for entry in out.prompt_logprobs[1:]]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return top1


@pytest.fixture(scope="module")
def bf16_top1() -> list[int]:
    return _top1()


@pytest.mark.parametrize("options, floor", [
    (dict(kv_cache_dtype="fp8"), 0.90),
    (dict(quantization="fp8"), 0.85),
    (dict(quantization="fp8", kv_cache_dtype="fp8"), 0.80),
])
def test_fp8_agrees_with_bf16(bf16_top1, options, floor):
    top1 = _top1(**options)
    agreement = sum(a == b for a, b in zip(top1, bf16_top1)) / len(bf16_top1)
    print(f"\n{options}: top-1 agreement with bf16 {agreement:.4f} over {len(bf16_top1)} positions")
    assert len(bf16_top1) >= 1000 and agreement >= floor, agreement
