"""SwiGLU's activation: silu(gate) * up over a packed [gate | up] tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.compile import cuda_compiled, eager_unless_compiling


@cuda_compiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self._silu_and_mul = eager_unless_compiling(silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(x)
