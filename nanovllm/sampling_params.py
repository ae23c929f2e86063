"""SamplingParams: how one request samples and when it stops (vLLM-shaped, validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check_number(name: str, value, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}.")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")


@dataclass
class SamplingParams:
    """Sampling settings of one request. ``temperature=0`` means greedy decoding."""

    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative (0 means greedy), got {self.temperature}.")
        _check_number("max_tokens", self.max_tokens, integer=True)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
