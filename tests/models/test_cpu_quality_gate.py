"""The quality gate of the CPU's default (platforms/cpu/linear.BlockLinear on the embedded GGUF's 4/8-bit blocks):
teacher-forced on SmolLM2's chat answers, its most likely next token is float32's at >= 97 % of the positions
(docs/benchmarks.md has the figures; benchmarks/cpu_quality.py measures other configurations the same way)."""

from __future__ import annotations

from benchmarks.cpu_quality import chat_prompts, greedy_answers, top1_tokens
from nanovllm import LLM
from nanovllm.platforms.cpu.linear import BlockLinear

PROMPTS, ANSWER_TOKENS = 16, 64  # 1,024 positions
GATE = 0.97
ENGINE = dict(max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=160)


def test_the_default_agrees_with_float32_at_97_percent_of_positions(monkeypatch) -> None:
    """The default answers (generating: the fast engine), then each engine scores those answers in one prefill each
    and we compare their top-1 tokens position by position."""
    monkeypatch.delenv("NANOVLLM_CPU_DTYPE", raising=False)  # the suite's float32 pin: a user's defaults instead
    llm = LLM(**ENGINE)
    assert llm.config.cpu_linear == "blocks", "the default on a CPU with AVX2 or AVX512-VNNI"
    assert isinstance(llm.runner.model.lm_head.linear_method, BlockLinear), "the LM head too"
    prompts = chat_prompts(llm, PROMPTS)
    answers = greedy_answers(llm, prompts, ANSWER_TOKENS)
    ours = top1_tokens(llm, prompts, answers)
    llm.close()
    reference = LLM(dtype="float32", **ENGINE)
    expected = top1_tokens(reference, prompts, answers)
    reference.close()
    assert len(ours) == len(expected) >= 1000
    agreement = sum(a == b for a, b in zip(ours, expected)) / len(ours)
    assert agreement >= GATE, f"top-1 agreement with float32 {100 * agreement:.1f} % < {100 * GATE:.0f} %"
