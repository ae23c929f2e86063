"""The fp8 KV cache's number format, in torch: e4m3 values times a scale per layer (one for K, one for V).

A cached value is ``round_e4m3(clamp(x / scale, -448, 448))``, read back as ``value * scale``. e4m3 is a float
format (3 mantissa bits, ~6 % relative step from 2^-6 to 448), so one scale per tensor only has to keep the
largest K/V of the layer below 448: the scale is 1.0 (vLLM's default without checkpoint scales; the K/V of the
models we run stay far below 448, and values past it saturate at 448 rather than overflow). A scale per layer
calibrated from a prefill of random tokens (its amax stored as 448 / 8) was tried and did worse on SmolLM2
(docs/benchmarks.md); checkpoint k_scale/v_scale are not read yet.
Attention applies the scales outside its inner loops: K's folds into the softmax scale, V's into the output.
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
