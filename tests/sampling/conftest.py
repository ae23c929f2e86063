"""A tiny random Qwen3 with a real (byte-level BPE) tokenizer of its 384-token vocabulary, built offline."""

from __future__ import annotations

import random

import pytest

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "héllo", "wörld",
         "日本語", "€uro", "naïve", "café", "stop", "STOP", "end", "and", "###", "\n\n"]


def train_byte_level_tokenizer(vocab_size: int = 384):
    """A GPT-2 style byte-level BPE (what Qwen / Llama 3 / SmolLM use) trained on a small synthetic corpus, so
    multi-byte characters can be split across tokens. Ids 0, 1, 2 are <pad>, <s>, </s> (the tiny model's EOS is 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) + rng.choice(["", "s", "ing", "ed"]) for _ in range(30))
              for _ in range(400)]
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == vocab_size
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="session")
def byte_tokenizer():
    return train_byte_level_tokenizer()


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory, byte_tokenizer) -> str:
    from tests.helpers import save_tiny_model

    path = save_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3-text"), seed=3)
    byte_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_model(tiny_text_model):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_text_model, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    from nanovllm import LLM

    return LLM(tiny_text_model, kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=256)
