"""Triton helpers for e4m3: the rounding the fp8 KV cache stores with (its format is described in
attention/kv_fp8.py), and the rows of activations quantized with a scale each for fp8 linear layers (plain, or
SwiGLU's silu(gate) * up computed and quantized in the same kernel; kernels/rms_norm.py's norm quantizes its rows
with e4m3_row)."""

from __future__ import annotations

import torch
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
    # the sign bit of x (of -0.0 too), so that what rounds to zero keeps its sign, as torch's cast does
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def kv_compute_dtype(q_dtype: torch.dtype, kv_fp8: bool):
    """The attention kernels' product dtype: q's, except over an fp8 cache of 16-bit queries: float16, which holds
    every e4m3 value exactly and is the cheaper upcast (one instruction per two values; bfloat16 takes a detour
    through float32). A bfloat16 q must then fit float16's range, as the queries of the models we run do."""
    if kv_fp8 and q_dtype != torch.float32:
        return tl.float16
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[q_dtype]


@triton.jit
def e4m3_to_f16_in_registers(x):
    """e4m3 -> float16, four values a 32-bit register through the hardware's cvt (sm_89 and later).

    A plain ``.to(tl.float16)`` of a tile feeding ``tl.dot`` is moved by the compiler to after the tile's read
    from shared memory, in the operand's layout; for the right operand of ``p @ v`` (keys along the reduction,
    head_dim contiguous in memory) that read is byte by byte, with as many instructions again to pack the bytes.
    The conversion here is an opaque (non-pure) asm the compiler does not move: the tile is read from shared
    memory in wide rows, converted, and rearranged as float16, which has a transposing shared-memory read."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


# the scale a row of zeros gets (its reciprocal would be infinite); layers/quantization/fp8.py uses the same
MIN_ROW_SCALE = tl.constexpr(1e-12)


@triton.jit
def e4m3_scale(largest):
    """A row's scale from its largest magnitude: it maps that magnitude to e4m3's largest value."""
    return tl.maximum(largest / FP8_MAX, MIN_ROW_SCALE)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, cols, stride_x, stride_out, BLOCK: tl.constexpr):
    """One program per row: its largest magnitude, then the row divided by max / 448 and rounded to e4m3."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    largest = tl.zeros([BLOCK], tl.float32)
    for start in range(0, cols, BLOCK):
        mask = start + offsets < cols
        x = tl.load(x_ptr + row * stride_x + start + offsets, mask=mask, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(x))
    scale = e4m3_scale(tl.max(largest, 0))
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        mask = start + offsets < cols
        x = tl.load(x_ptr + row * stride_x + start + offsets, mask=mask, other=0.0).to(tl.float32)
        # a division, not a product with 1 / scale: the same float32 quotient as the torch reference
        x = to_e4m3(x / scale, 1.0)
        tl.store(out_ptr + row * stride_out + start + offsets, x.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (unit stride on cols) -> (e4m3 [rows, cols], float32 scale [rows, 1]), one kernel: the same
    numbers as layers/quantization/fp8.quantize_rows, whose handful of torch kernels it replaces on CUDA."""
    assert x.dim() == 2 and x.stride(1) == 1, f"quantize_rows_e4m3 takes rows with unit stride, got {tuple(x.shape)}"
    return _quantize_by_row(_quantize_rows_kernel, x, x.shape[1], widest_block=4096)


def empty_e4m3_rows(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for rows in e4m3 [rows, cols] and their float32 scales [rows, 1]."""
    return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


def _quantize_by_row(kernel, x: torch.Tensor, cols: int, widest_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row of x, making cols e4m3 values and a scale each, in blocks of up to widest_block."""
    out, scale = empty_e4m3_rows(x.shape[0], cols, x.device)
    if x.shape[0]:
        block = min(triton.next_power_of_2(max(cols, 16)), widest_block)
        kernel[(x.shape[0],)](x, out, scale, cols, x.stride(0), out.stride(0), BLOCK=block,
                              num_warps=4 if block <= widest_block // 2 else 8)
    return out, scale


@triton.jit
def _round_to_bfloat16(x):
    """float32 -> the nearest bfloat16 (ties to even), still float32: in integer arithmetic, because the Triton
    interpreter's cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(y, dtype: tl.constexpr):
    """float32 y rounded to dtype (as a 16-bit tensor of it would store y), still float32."""
    if dtype == tl.bfloat16:
        return _round_to_bfloat16(y)
    return y.to(dtype).to(tl.float32)


@triton.jit
def e4m3_row(y, mask):
    """A whole row y (float32, held by one program; mask: its columns) -> (y / scale rounded to e4m3, scale), scale =
    max |y| / 448: quantize_rows_e4m3's numbers for a row already in registers."""
    scale = e4m3_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), 0))
    return to_e4m3(y / scale, 1.0), scale


@triton.jit
def _silu_and_mul_row(x_ptr, row_offset, cols, start, offsets):
    """silu(gate) * up for one block of a packed [gate | up] row, in float32, rounded to x's dtype as the
    unfused activation (layers/activation.py) stores it."""
    mask = start + offsets < cols
    gate = tl.load(x_ptr + row_offset + start + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row_offset + cols + start + offsets, mask=mask, other=0.0).to(tl.float32)
    return round_to(gate / (1.0 + tl.exp(-gate)) * up, x_ptr.dtype.element_ty), mask


@triton.jit
def _silu_and_mul_quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, cols, stride_x, stride_out, BLOCK: tl.constexpr):
    """One program per row: the activation's largest magnitude, then the activation (computed again: its inputs
    are still in cache) divided by max / 448 and rounded to e4m3."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    largest = tl.zeros([BLOCK], tl.float32)
    for start in range(0, cols, BLOCK):
        y, mask = _silu_and_mul_row(x_ptr, row * stride_x, cols, start, offsets)
        largest = tl.maximum(largest, tl.abs(y))
    scale = e4m3_scale(tl.max(largest, 0))
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        y, mask = _silu_and_mul_row(x_ptr, row * stride_x, cols, start, offsets)
        tl.store(out_ptr + row * stride_out + start + offsets, to_e4m3(y / scale, 1.0).to(out_ptr.dtype.element_ty),
                 mask=mask)


def silu_and_mul_quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, 2 * cols] packed [gate | up] (unit stride) -> quantize_rows_e4m3(silu(gate) * up), one kernel: the
    activation never goes through memory in 16 bits. The numbers of layers/quantization/fp8's
    silu_and_mul_quantize_rows, up to the last bit of exp."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, (
        f"silu_and_mul_quantize_rows_e4m3 takes packed [gate | up] rows with unit stride, got {tuple(x.shape)}")
    return _quantize_by_row(_silu_and_mul_quantize_rows_kernel, x, x.shape[1] // 2, widest_block=2048)
