"""The speculative_config engine argument (vLLM's names), parsed and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup (n-gram) speculation: the next tokens are guessed from the request's own earlier tokens.

    num_speculative_tokens: draft tokens proposed (and verified) per step at most.
    prompt_lookup_max / prompt_lookup_min: the longest and shortest n-gram (ending at the newest token) that is
    looked up in the request's earlier tokens; the longest one found wins.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}.")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}.")
        if self.num_speculative_tokens > 32:
            raise ValueError(f"speculative_config num_speculative_tokens must be at most 32, "
                             f"got {self.num_speculative_tokens}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max}).")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From LLM(speculative_config={...}) or --speculative-config '{...}' (JSON); None or {} = off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {value!r}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), got {type(value).__name__}.")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(known)}.")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method' (one of {METHODS}).")
        return cls(**value)
