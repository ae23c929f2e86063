"""SwiGLU's activation: silu(gate) * up over a packed [gate | up] tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_ops
from nanovllm.layers.compile import cuda_compiled


@cuda_compiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda and x.dim() == 2 and x.is_contiguous() and cpu_ops.usable(x):
            return cpu_ops.silu_and_mul(x)  # CPU: one compiled call instead of three torch ops
        return silu_and_mul(x)
