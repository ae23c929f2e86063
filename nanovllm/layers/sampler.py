"""Token sampling on the device without a host sync: greedy, or Gumbel-max via exponential noise."""

from __future__ import annotations

import torch
from torch import nn


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """logits: [num_seqs, vocab] float32; temperatures: [num_seqs] (0 = greedy) -> token ids [num_seqs].

        argmax(p / E) with E ~ Exponential(1) is a sample from p, and needs no cumulative sum or host sync.
        """
        greedy = logits.argmax(dim=-1)
        scaled = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)
