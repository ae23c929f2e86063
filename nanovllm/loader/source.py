"""Find the model: its path, Hugging Face config, tokenizer and every EOS id it declares."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass
class ModelSource:
    path: str
    hf_config: object
    tokenizer: object | None  # None for a config-only folder (dummy weights): prompts must be token ids
    eos_token_ids: set[int]


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _has_tokenizer_files(folder: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.exists(os.path.join(folder, n)) for n in names)


def resolve_model(model: str | None, tokenizer_path: str | None = None) -> ModelSource:
    if model is None:
        from nanovllm.loader.default_model import embedded_model_path
        model = embedded_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model path {model!r} does not exist")

    from nanovllm.loader.gguf import is_gguf

    if is_gguf(model):
        from nanovllm.loader.gguf import load_gguf_config, load_gguf_tokenizer
        hf_config = load_gguf_config(model)
        tokenizer = _auto_tokenizer(tokenizer_path) if tokenizer_path else load_gguf_tokenizer(model)
        generation_eos: set[int] = set()
    else:
        if not os.path.exists(os.path.join(model, "config.json")):
            raise FileNotFoundError(f"model folder {model!r} has no config.json")
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(model)
        tok_path = tokenizer_path or model
        tokenizer = _auto_tokenizer(tok_path) if _has_tokenizer_files(tok_path) else None
        generation_eos = _generation_config_eos(model)

    eos = _ids(getattr(hf_config, "eos_token_id", None)) | generation_eos
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return ModelSource(model, hf_config, tokenizer, eos)


def _auto_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _generation_config_eos(folder: str) -> set[int]:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return _ids(json.load(f).get("eos_token_id"))
