"""Prompts to token ids, and the checks a request must pass before it may join the engine.

Needs the tokenizer and a few fixed numbers of the engine (``RequestLimits``), not the engine itself: the server's
front end runs these in its own process, the engine core never sees a request that fails them.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

from nanovllm.chat_template import apply_chat_template
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int] | dict


@dataclass(frozen=True)
class RequestLimits:
    """The engine's fixed numbers a request is checked against."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # the whole KV pool: num_kvcache_blocks * block size
    supports_prompt_logprobs: bool = True  # False under tensor parallelism without the gathered logits


class InputProcessor:
    def __init__(self, tokenizer, limits: RequestLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a string, a list of token ids, or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one token.")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as lists of token ids.")
            check_unicode(prompt, "the prompt")
            return prompt, self.check_token_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, SequenceABC):
            return None, self.check_token_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    def check_token_ids(self, token_ids) -> list[int]:
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token.")
        vocab_size = self.limits.vocab_size
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab_size}).")
        return token_ids

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        limits = self.limits
        n = len(token_ids)
        if n >= limits.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, but max_model_len is {limits.max_model_len}: it must be "
                             f"shorter, leaving room for at least one generated token.")
        longest = (limits.max_model_len if params.max_tokens is None
                   else min(n + params.max_tokens, limits.max_model_len))
        capacity = limits.kv_capacity_tokens
        if longest > capacity:
            raise ValueError(f"the request needs up to {longest} tokens of KV cache (prompt {n} + max_tokens "
                             f"{params.max_tokens}), but the whole pool holds {capacity}; raise "
                             f"num_kvcache_blocks or the KV cache memory, or lower max_tokens.")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer, and this model has none; "
                             "use stop_token_ids.")
        for t in params.stop_token_ids:
            if t >= limits.vocab_size:
                raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {limits.vocab_size}).")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            for t in ids:
                if t >= limits.vocab_size:
                    raise ValueError(f"{name} holds token id {t}, outside the vocabulary [0, {limits.vocab_size}).")
        if (params.structured_outputs is not None or params.bad_words) and self.tokenizer is None:
            raise ValueError("structured_outputs and bad_words need a tokenizer, and this model has none.")
        if params.prompt_logprobs is not None and not limits.supports_prompt_logprobs:
            raise ValueError("prompt_logprobs is not supported with tensor_parallel_size > 1 yet.")

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        return apply_chat_template(self.tokenizer, conversation, add_generation_prompt, chat_template_kwargs)


def check_unicode(text: str, what: str) -> None:
    """Raise ValueError if ``text`` cannot be encoded as UTF-8 (a lone surrogate, e.g. from a JSON "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: it holds a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}.") from None
