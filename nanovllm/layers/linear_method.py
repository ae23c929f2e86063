"""How a linear layer multiplies: one object per layer, chosen once at load time.

A layer's forward is ``self.linear_method.apply(self, x, bias)``. The default multiplies by the layer's own
``weight`` (F.linear: CUDA, and the CPU in float32 or bfloat16); a platform gives a layer another method after its
weights load (platforms/cpu/linear.py: oneDNN-packed, float16, int8, or 4/8-bit blocks), which holds its own copy of
the weight. A new weight format (fp8, a fused MoE's experts) is one more subclass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LinearMethod:
    """y = x W^T (+ b) for a layer: the default reads the layer's float weight."""

    # the method keeps its own copy of the weight: the layer's float parameter may be released after loading
    owns_weight = False

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = LinearMethod()  # holds nothing: every layer may share it
