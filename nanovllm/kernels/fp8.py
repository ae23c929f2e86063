"""Triton helpers for the fp8 (e4m3) KV cache; the format itself is described in attention/kv_fp8.py."""

from __future__ import annotations

import triton
import triton.language as tl

# a compiled kernel reads only constexpr globals (the interpreter reads any, so only the GPU would fail)
FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value
# adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to the nearest integer (ties to even)
_ROUNDING_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def to_e4m3(x, inv_scale):
    """x / scale (float32) saturated to +-448 and rounded to the nearest e4m3 value (ties to even), still float32.

    The rounding is done here in float32 arithmetic, so the cast that follows is exact: the same bits on the GPU
    and under the Triton interpreter (whose own float32 -> fp8 cast rounds some values wrongly)."""
    x = tl.minimum(tl.maximum(x * inv_scale, -FP8_MAX), FP8_MAX)
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # 3 mantissa bits: a step of 2^(exponent - 3); subnormals (below 2^-6) share the step 2^-9
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(x) / step + _ROUNDING_MAGIC) - _ROUNDING_MAGIC) * step
    return tl.where(x < 0, -magnitude, magnitude)  # what rounds to zero keeps its sign, as torch's cast does
