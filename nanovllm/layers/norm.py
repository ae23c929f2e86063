"""RMSNorm, optionally fused with the residual add that precedes it: for a decode step's few CUDA rows our Triton
kernel (kernels/rms_norm.py, whose launch overlaps its neighbours'), before an fp8 linear layer the same kernel
with its rows in e4m3, for anything else the ops below."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.compile import cuda_compiled, eager_unless_compiling


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
    # set (models/decoder.quantize_norm_outputs) where the one layer reading the norm's rows is an fp8 linear layer
    # that multiplies e4m3 rows: rows above a decode step's come out as its QuantizedRows, from one kernel
    e4m3_output = False

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self._rms_norm, self._add_rms_norm = eager_unless_compiling(rms_norm), eager_unless_compiling(add_rms_norm)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from nanovllm.kernels import rms_norm as kernel  # Triton only on CUDA
            if kernel.takes(x, self.weight, residual):
                return kernel.add_rms_norm(x, self.weight, self.eps, residual)
            if self.e4m3_output and kernel.fits(x, self.weight, residual) and self.weight.dtype == x.dtype:
                return self._e4m3(x, residual)
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        return self._add_rms_norm(x, residual, self.weight, self.eps)

    def _e4m3(self, x: torch.Tensor, residual: torch.Tensor | None):
        from nanovllm.kernels.rms_norm import add_rms_norm_e4m3
        from nanovllm.layers.quantization.fp8 import QuantizedRows
        values, scale, summed = add_rms_norm_e4m3(x, self.weight, self.eps, residual)
        normed = QuantizedRows(values, scale, x.dtype)
        return normed if residual is None else (normed, summed)
