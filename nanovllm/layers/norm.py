"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_ops
from nanovllm.layers.compile import cuda_compiled
from nanovllm.platforms.cpu.row_scale import RowScaled, fbgemm_takes


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # float32 statistics, as the reference implementation computes them
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@cuda_compiled
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm.__wrapped__(x, weight, eps), x


class RMSNorm(nn.Module):
    # cpu_int8: the output feeds an int8 linear, so it comes normalized, as RowScaled (set by the model)
    emits_row_scaled = False

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor | RowScaled, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual). x may be an int8 linear's RowScaled
        product; norm(...) is RowScaled when emits_row_scaled (on the CPU's compiled path)."""
        x_scale = None
        if isinstance(x, RowScaled):
            x, x_scale = x
        if not x.is_cuda and x.dim() == 2 and x.is_contiguous() and cpu_ops.usable(x) and (
                residual is not None or x_scale is None):
            # CPU with the compiled ops: the add and the norm in one call (F.rms_norm alone takes ~30 us a row),
            # and the row scales on the way in and out
            normalize_out = self.emits_row_scaled and fbgemm_takes(x.shape[0])
            out = cpu_ops.add_rms_norm(x, self.weight, self.eps, None if residual is None else residual.contiguous(),
                                       x_scale, normalize_out)
            if not normalize_out:
                return out
            return RowScaled(*out) if residual is None else (RowScaled(*out[0]), out[1])
        if x_scale is not None:
            x = x * x_scale
        if not x.is_cuda and x.dtype == torch.float32:
            # CPU: torch's one rms_norm call computes the same float32 result as rms_norm above in one dispatch
            # instead of seven (each costs microseconds, and a decode step normalises 61 times)
            if residual is not None:
                x = x + residual
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return out if residual is None else (out, x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
