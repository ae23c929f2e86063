"""quantization="fp8": a float checkpoint's linear weights become e4m3 at load, with a scale per output channel;
each call quantizes its activations with a scale per token (dynamic), and multiplies them through
torch._scaled_mm on CUDA (Hopper's fp8 tensor cores, twice the bf16 rate) or, elsewhere, through the same
numbers dequantized (the reference the tests run on the CPU).

    w_fp8[n, k] = round_e4m3(w[n, k] / w_scale[n]),  w_scale[n] = max_k |w[n, k]| / 448
    x_fp8[m, k] = round_e4m3(x[m, k] / x_scale[m]),  x_scale[m] = max_k |x[m, k]| / 448
    y[m, n] = x_scale[m] * w_scale[n] * sum_k x_fp8[m, k] w_fp8[n, k]  (+ bias[n])
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.linear_method import UNQUANTIZED, LinearMethod

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# a row of zeros gets this scale rather than 0 (whose reciprocal would give NaN)
MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] float -> (e4m3 [rows, cols], float32 scale [rows, 1]): a symmetric scale per row."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(MIN_SCALE)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8LinearMethod(LinearMethod):
    """y = x W^T (+ b) with e4m3 weights (a scale per output channel) and e4m3 activations (a scale per token)."""

    owns_weight = True

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.weight, scale = quantize_rows(weight)  # [out, in] e4m3; scale [out, 1]
        self.weight_scale = scale.view(1, -1).contiguous()  # [1, out], as _scaled_mm takes a column scale
        # _scaled_mm takes sizes in multiples of 16; others (none in the models we run) take the reference path
        self.scaled_mm = weight.is_cuda and self.in_features % 16 == 0 and self.out_features % 16 == 0

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):  # rows with their scale apart (platforms/cpu/row_scale.RowScaled)
            x = x.materialize()
        rows = x.reshape(-1, self.in_features)
        x_fp8, x_scale = quantize_rows(rows)
        if self.scaled_mm:
            # weight.t(): [in, out] column-major, the layout _scaled_mm wants for its second operand
            y = torch._scaled_mm(x_fp8, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale,
                                 bias=bias, out_dtype=x.dtype)
        else:
            y = (x_fp8.float() * x_scale) @ (self.weight.float() * self.weight_scale.view(-1, 1)).t()
            if bias is not None:
                y = y + bias.float()
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def quantize_linear_layers(model: nn.Module) -> int:
    """Give every linear layer of a loaded model (not the embedding or the LM head) an Fp8LinearMethod, whose e4m3
    copy replaces the float weight; returns how many."""
    from nanovllm.layers.linear import LinearBase
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and module.linear_method is UNQUANTIZED:
            module.linear_method = Fp8LinearMethod(module.weight.data)
            module.weight.data = module.weight.data.new_empty(0)  # loading is over: one copy of the weights
            count += 1
    return count
