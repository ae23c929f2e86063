"""SwiGLU's activation: silu(gate) * up over a packed [gate | up] tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_ops
from nanovllm.layers.compile import cuda_compiled
from nanovllm.platforms.cpu.row_scale import RowScaled, fbgemm_takes


@cuda_compiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    # cpu_int8: the output feeds an int8 linear, so it comes normalized, as RowScaled (set by the model)
    emits_row_scaled = False

    def forward(self, x: torch.Tensor | RowScaled) -> torch.Tensor | RowScaled:
        """x may be an int8 linear's RowScaled product."""
        in_scale = None
        if isinstance(x, RowScaled):
            x, in_scale = x
        if not x.is_cuda and x.dim() == 2 and x.is_contiguous() and cpu_ops.usable(x):
            # CPU: one compiled call instead of three torch ops, with the row scales on the way in and out
            normalize_out = self.emits_row_scaled and fbgemm_takes(x.shape[0])
            out = cpu_ops.silu_and_mul(x, in_scale, normalize_out)
            return RowScaled(*out) if normalize_out else out
        return silu_and_mul(x if in_scale is None else x * in_scale)
