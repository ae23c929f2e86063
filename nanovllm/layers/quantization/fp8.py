"""quantization="fp8": a float checkpoint's linear weights become e4m3 at load, with a scale per output channel;
each call quantizes its activations with a scale per token (dynamic), and multiplies them through
torch._scaled_mm on CUDA (Hopper's fp8 tensor cores, twice the bf16 rate) or, elsewhere, through the same
numbers dequantized (the reference the tests run on the CPU). On CUDA the activations are quantized by one Triton
kernel (kernels/fp8.py); decode-sized batches (up to 16 rows) multiply their 16-bit activations, unquantized, in the
few-row GEMM (kernels/skinny_gemm.py), which upcasts the e4m3 weight as it reads it and, for SwiGLU's gate_up,
applies SiLU-and-mul in the same kernel. Larger batches compute SwiGLU's silu(gate) * up and quantize it for
down_proj in one kernel: gate_up hands down_proj QuantizedRows, not 16-bit rows.

    w_fp8[n, k] = round_e4m3(w[n, k] / w_scale[n]),  w_scale[n] = max_k |w[n, k]| / 448
    x_fp8[m, k] = round_e4m3(x[m, k] / x_scale[m]),  x_scale[m] = max_k |x[m, k]| / 448
    y[m, n] = x_scale[m] * w_scale[n] * sum_k x_fp8[m, k] w_fp8[n, k]  (+ bias[n])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
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


def silu_and_mul_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(silu(gate) * up) of packed [gate | up] rows, the activation rounded to x's dtype first (the
    reference of kernels/fp8.silu_and_mul_quantize_rows_e4m3)."""
    gate, up = x.float().chunk(2, dim=-1)
    return quantize_rows((F.silu(gate) * up).to(x.dtype))


class QuantizedRows(NamedTuple):
    """Rows already in e4m3 with a scale each, standing for rows of ``dtype``: what an fp8 gate_up hands to
    down_proj, whose own quantizing kernel it saves."""

    values: torch.Tensor  # [rows, cols] e4m3
    scale: torch.Tensor   # [rows, 1] float32
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def is_cuda(self) -> bool:
        return self.values.is_cuda

    def materialize(self) -> torch.Tensor:
        return (self.values.float() * self.scale).to(self.dtype)


class Fp8LinearMethod(LinearMethod):
    """y = x W^T (+ b) with e4m3 weights (a scale per output channel) and e4m3 activations (a scale per token)."""

    owns_weight = True

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.weight, scale = quantize_rows(weight)  # [out, in] e4m3; scale [out, 1]
        self.weight_scale = scale.view(1, -1).contiguous()  # [1, out], as _scaled_mm takes a column scale
        # _scaled_mm takes sizes in multiples of 16; others (none in the models we run) take the reference path
        self.scaled_mm = weight.is_cuda and self.in_features % 16 == 0 and self.out_features % 16 == 0
        self.weight_scale_rows = self.weight_scale.view(-1)  # the few-row GEMM's scale per weight row

    # decode-sized batches: False multiplies the 16-bit activations as they are by the upcast e4m3 weight (no
    # quantizing kernel, and the more exact), True e4m3 activations (the numbers of _scaled_mm); the H200's
    # figures for both are in docs/benchmarks.md
    few_row_fp8_activations = False
    # whether the RMSNorm before the layer hands it e4m3 rows above a decode step's (models/decoder.
    # quantize_norm_outputs: one kernel fewer a norm; faster on the 8B shape, docs/benchmarks.md)
    norm_hands_e4m3_rows = True

    @property
    def multiplies_e4m3_rows(self) -> bool:
        # the reference (CPU) dequantizes them: rows in e4m3 would save it nothing
        return self.scaled_mm and self.norm_hands_e4m3_rows

    # the row counts whose product runs in our Triton GEMM (kernels/fp8_gemm.py) rather than cuBLAS's; None keeps
    # every product in cuBLAS, until the Triton GEMM is measured faster on the card (benchmarks/skinny_gemm.py --fp8)
    triton_gemm_rows: tuple[int, int] | None = None

    def _triton_gemm_takes(self, rows: int) -> bool:
        if not self.scaled_mm or self.triton_gemm_rows is None:
            return False
        from nanovllm.kernels.fp8_gemm import takes
        return self.triton_gemm_rows[0] <= rows <= self.triton_gemm_rows[1] and takes(self.in_features)

    def _few_rows(self, rows: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor | None:
        """The product in the few-row GEMM when it takes these rows (CUDA, decode-sized), else None."""
        if not rows.is_cuda:
            return None
        from nanovllm.kernels import fp8, skinny_gemm
        if not skinny_gemm.takes(rows, self.weight, gated):
            return None
        if not self.few_row_fp8_activations:
            return skinny_gemm.skinny_linear(rows, self.weight, bias, gated=gated,
                                             weight_scale=self.weight_scale_rows)
        x_fp8, x_scale = fp8.quantize_rows_e4m3(rows)
        return skinny_gemm.skinny_linear(x_fp8, self.weight, bias, gated=gated, weight_scale=self.weight_scale_rows,
                                         x_scale=x_scale, out_dtype=rows.dtype)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                           act: nn.Module) -> torch.Tensor | QuantizedRows:
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            y = self._few_rows(x, bias, gated=True)
            if y is not None:
                return y
        gate_up = self.apply(layer, x, bias)
        if self.scaled_mm and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            from nanovllm.kernels.fp8 import silu_and_mul_quantize_rows_e4m3
            return QuantizedRows(*silu_and_mul_quantize_rows_e4m3(gate_up), gate_up.dtype)
        return act(gate_up)

    def _quantized(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
        """x's rows [rows, in_features] in e4m3, their scales and the dtype they stand for."""
        if isinstance(x, QuantizedRows):
            return x.values, x.scale, x.dtype
        rows = x.reshape(-1, self.in_features)
        if rows.is_cuda and rows.stride(-1) == 1:
            from nanovllm.kernels.fp8 import quantize_rows_e4m3
            return *quantize_rows_e4m3(rows), x.dtype
        return *quantize_rows(rows), x.dtype

    def apply(self, layer: nn.Module, x, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(x, (torch.Tensor, QuantizedRows)):  # rows with their scale apart (cpu's RowScaled)
            x = x.materialize()
        if isinstance(x, torch.Tensor):
            rows = x.reshape(-1, self.in_features)
            y = self._few_rows(rows, bias, gated=False) if rows.stride(-1) == 1 else None
            if y is not None:
                return y.view(*x.shape[:-1], self.out_features)
        x_fp8, x_scale, dtype = self._quantized(x)
        if self._triton_gemm_takes(x_fp8.shape[0]):
            from nanovllm.kernels.fp8_gemm import fp8_linear
            y = fp8_linear(x_fp8, x_scale, self.weight, self.weight_scale_rows, bias, dtype)
        elif self.scaled_mm:
            # weight.t(): [in, out] column-major, the layout _scaled_mm wants for its second operand
            y = torch._scaled_mm(x_fp8, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale,
                                 bias=bias, out_dtype=dtype)
        else:
            y = (x_fp8.float() * x_scale) @ (self.weight.float() * self.weight_scale.view(-1, 1)).t()
            if bias is not None:
                y = y + bias.float()
            y = y.to(dtype)
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


# -- HF fp8 checkpoints (quantization_config quant_method "fp8", block-wise weight_scale_inv) --------------------
def checkpoint_block_size(hf_config) -> tuple[int, int] | None:
    """An HF fp8 checkpoint's weight blocks [rows, cols] (its quantization_config), or None for a float one."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"the checkpoint's quantization_config quant_method {method!r} is not supported "
                         f"(only 'fp8', block-wise)")
    block = quant.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"fp8 checkpoints need a weight_block_size of two numbers (block-wise scales); got "
                         f"{block!r}: per-tensor fp8 checkpoints are not supported")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 activation_scheme {quant['activation_scheme']!r} is not supported (only 'dynamic')")
    return int(block[0]), int(block[1])


def add_block_scales(model: nn.Module, block: tuple[int, int]) -> None:
    """Before loading an fp8 checkpoint: every linear layer gets a `weight_scale_inv` parameter, one float32 per
    output row and group of block[1] inputs (kernels/fp8_block_gemm.py), sharded by the layer's own loader.
    The layer's weight keeps the model's dtype while loading: e4m3 values are exact in bfloat16 and float32."""
    from nanovllm.layers.fused_moe import FusedExperts
    from nanovllm.layers.linear import LinearBase
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            raise ValueError("fp8 (block-wise) checkpoints of mixture-of-experts models are not supported yet")
        if not isinstance(module, LinearBase):
            continue
        rows, cols = module.weight.shape
        if cols % block[1]:
            raise ValueError(f"{name}: {cols} inputs (per rank) are not a multiple of the checkpoint's fp8 block "
                             f"{block[1]}")
        scale = nn.Parameter(torch.empty(rows, cols // block[1], dtype=torch.float32), requires_grad=False)
        scale.weight_loader = module.weight_loader
        module.register_parameter("weight_scale_inv", scale)


def expand_block_scales(tensors, shapes: dict[str, tuple[int, ...]], block: tuple[int, int]):
    """A checkpoint's tensors with each block scale [ceil(N / bn), K / bk] repeated over its rows ([N, K / bk],
    N from the weight's shape): the layers then cut their shards from it as from their weights."""
    from nanovllm.kernels.fp8_block_gemm import scale_rows  # triton: imported only for fp8 checkpoints
    for name, tensor in tensors:
        if name.endswith(".weight_scale_inv"):
            tensor = scale_rows(tensor, block[0], shapes[name.removesuffix("_scale_inv")][0])
        yield name, tensor


class Fp8BlockLinearMethod(LinearMethod):
    """y = x W^T (+ b) with an fp8 checkpoint's e4m3 weight and block scales, through the block-scaled Triton GEMM
    (activations per token and group of block_k inputs)."""

    owns_weight = True

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, block_k: int):
        from nanovllm.kernels.fp8_block_gemm import block_fp8_linear
        self.weight, self.scales, self.block_k = weight.to(FP8_DTYPE), scales.contiguous(), block_k
        self.gemm = block_fp8_linear

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            x = x.materialize()
        return self.gemm(x, self.weight, self.scales, self.block_k, bias)


def use_block_scales(model: nn.Module, block: tuple[int, int]) -> int:
    """After loading an fp8 checkpoint: on CUDA each linear layer multiplies its e4m3 weight through
    Fp8BlockLinearMethod; elsewhere its weight is dequantized into the model's dtype (the platform then picks a
    method for it). Returns how many layers."""
    from nanovllm.layers.linear import LinearBase
    count = 0
    for module in model.modules():
        if not isinstance(module, LinearBase) or "weight_scale_inv" not in module._parameters:
            continue
        scales = module._parameters.pop("weight_scale_inv").data
        weight = module.weight.data
        if weight.is_cuda:
            module.linear_method = Fp8BlockLinearMethod(weight, scales, block[1])
            module.weight.data = weight.new_empty(0)
        else:
            module.weight.data = (weight.float() * scales.repeat_interleave(block[1], 1)).to(weight.dtype)
        count += 1
    return count
