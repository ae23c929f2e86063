"""The CPU's part of sampling: greedy tokens through the compiled ops, given to the runner's Sampler at load."""

from __future__ import annotations

import torch

from nanovllm.platforms.cpu import cpu_ops


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), ties to the lowest id; float32 rows through the compiled ops (vectorized, a thread
    per row range: torch's argmax over a 64-request step's logits takes ~4 ms on one core)."""
    if logits.dim() == 2 and logits.stride(-1) == 1 and cpu_ops.usable(logits):
        return cpu_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)
