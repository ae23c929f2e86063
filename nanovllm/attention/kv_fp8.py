"""The fp8 KV cache's number format, in torch: e4m3 values times a scale per layer (one for K, one for V).

A cached value is ``round_e4m3(clamp(x / scale, -448, 448))``, read back as ``value * scale``. The scale is the
checkpoint's ``k_scale`` / ``v_scale`` where it has them (loader/weights.py), else 1.0 (vLLM's default): e4m3 is
a float format (3 mantissa bits, a relative step of 6-12 % from 2^-6 to 448), so a scale only has to keep K/V
below 448 and above the subnormals, and the K/V of the models we run sit inside that range at 1.0. Calibrated
scales per layer or per (layer, KV head), dynamic scales per token and KV head stored beside the cache, K and V
shifted by a calibrated mean, a Hadamard rotation and keeping the first tokens unquantized were measured on SmolLM2
against the bfloat16 cache (docs/benchmarks.md): the 3 mantissa bits bound the error whatever the scale, and the
best of them (per token and head) gained 1-1.5 points of top-1 agreement for 4 more bytes per token and head and a
scale load per key, so the cache keeps one number per layer and no state beside the values. Attention applies the scales outside its inner loops: K's folds into the softmax scale, V's
into the output.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache of ``dtype`` stores it (fp8: divided by scale, saturated, rounded to nearest even)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(dtype)  # as the kernels: times 1 / scale


def as_bits(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8, for the copies and gathers torch does not implement for fp8 on the CPU
    (index_copy_, index_select); other tensors as they are. ``from_bits`` undoes it."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return bits.view(dtype) if is_fp8(dtype) else bits
