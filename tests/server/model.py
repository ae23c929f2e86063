"""A tiny random model with a real byte-level BPE tokenizer and a chat template, for server tests."""

from __future__ import annotations

import os

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4; the model's EOS is 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Paged attention keeps keys and values in fixed-size blocks of one pool.",
    "Continuous batching lets new requests join the running batch at every step.",
    "Once upon a time there was a small language model that answered every question.",
]


def save_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    assert tok.get_vocab_size() <= vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def save_tiny_chat_model(path, family: str = "qwen3", seed: int = 0) -> str:
    """A random tiny model folder (vocab 384) with the tokenizer above saved beside it."""
    from tests.helpers import TINY_COMMON, save_tiny_model

    path = str(path)
    save_tiny_model(family, path, seed=seed)
    save_tokenizer(path, TINY_COMMON["vocab_size"])
    assert os.path.exists(os.path.join(path, "tokenizer.json"))
    return path
