"""How a linear layer multiplies: one object per layer, chosen once at load time.

A layer's forward is ``self.linear_method.apply(self, x, bias)``. The default multiplies by the layer's own
``weight`` (F.linear: CUDA, and the CPU in float32 or bfloat16); a platform gives a layer another method after its
weights load (platforms/cpu/linear.py: oneDNN-packed, float16, int8, or 4/8-bit blocks), which holds its own copy of
the weight. A new weight format (fp8, a fused MoE's experts) is one more subclass.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _skinny_gemm():
    """kernels/skinny_gemm.py, imported on the first CUDA product: it imports Triton, whose library alone keeps
    ~66 MB resident in a CPU engine that never launches it."""
    from nanovllm.kernels import skinny_gemm
    return skinny_gemm


class LinearMethod:
    """y = x W^T (+ b) for a layer: the default reads the layer's float weight, on CUDA through the few-row
    kernel (kernels/skinny_gemm.py) for decode-sized batches where it beats the library's GEMM."""

    # the method keeps its own copy of the weight: the layer's float parameter may be released after loading
    owns_weight = False
    # the method takes its input as e4m3 rows with a scale each (layers/quantization/fp8.QuantizedRows) and saves
    # its own quantizing kernel by it (the norm before it may then hand it such rows)
    multiplies_e4m3_rows = False

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            skinny_gemm = _skinny_gemm()
            if skinny_gemm.takes(x, layer.weight):
                return skinny_gemm.skinny_linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def apply_silu_and_mul(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                           act: torch.nn.Module) -> torch.Tensor:
        """act(x W^T + b) for SwiGLU's packed [gate | up] projection, act being its silu(gate) * up; the default
        method does both in one kernel where the few-row kernel takes the product."""
        if not self.owns_weight and x.is_cuda:  # (a method that owns its weight may take a RowScaled x)
            skinny_gemm = _skinny_gemm()
            if skinny_gemm.takes(x, layer.weight, gated=True):
                return skinny_gemm.skinny_linear(x, layer.weight, bias, gated=True)
        return act(self.apply(layer, x, bias))


UNQUANTIZED = LinearMethod()  # holds nothing: every layer may share it
