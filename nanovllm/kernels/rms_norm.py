"""RMSNorm, optionally after the residual add before it, as one Triton kernel with an overlapped launch (CUDA).

torch.compile fuses the same ops into one kernel, but that kernel cannot overlap its launch with its neighbours
(kernels/jit.py): in a decode step every other kernel of a layer is ours and overlapped, and the few-row GEMM
after each norm reads its weight while the norm still runs (kernels/skinny_gemm.py). One program per row;
the statistics in float32, rounded as layers/norm.py's rms_norm rounds them::

    s = x + residual                        (in x's dtype; stored as the new residual)
    out = weight * (s * rsqrt(mean(s^2) + eps)).to(x's dtype)

add_rms_norm_e4m3 stores out in e4m3 with a scale per row instead (kernels/fp8.py's quantize_rows_e4m3 of the
16-bit out, without the 16-bit row going through memory): for an fp8 linear layer after the norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import e4m3_row, empty_e4m3_rows, round_to
from nanovllm.kernels.jit import overlap_options, wait_for_prior_kernel
from nanovllm.kernels.skinny_gemm import MAX_ROWS

# the widest row one program holds (Llama-3-70B's hidden size is 8,192)
MAX_HIDDEN = 16384


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr,        # [rows, N], unit stride on N; residual read only when HAS_RESIDUAL
    weight_ptr,                 # [N]
    out_ptr, residual_out_ptr,  # [rows, N] contiguous; residual_out written only when HAS_RESIDUAL
    scale_ptr,                  # [rows] float32, written only when QUANTIZE (out is then e4m3)
    stride_x, stride_residual,
    N, eps,
    BLOCK: tl.constexpr,        # next power of two >= N
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    OVERLAP: tl.constexpr,
):
    wait_for_prior_kernel(OVERLAP)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * N + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = weight * normed
    if QUANTIZE:  # the row as a 16-bit out would hold it, then in e4m3
        out, scale = e4m3_row(round_to(out, x_ptr.dtype.element_ty), mask)
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether add_rms_norm takes these: rows [rows, N <= MAX_HIDDEN] with unit stride on N, a [N] weight, and a
    residual of x's shape and dtype (on CUDA, or any device under the Triton interpreter)."""
    return (x.dim() == 2 and x.stride(-1) == 1 and 0 < x.shape[1] <= MAX_HIDDEN
            and weight.shape == (x.shape[1],) and weight.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(-1) == 1)))


def takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether a layer should norm these rows here: CUDA rows that fit, as few as a decode step's (<= MAX_ROWS),
    where the few-row GEMM after the norm overlaps it. Larger steps keep torch.compile's kernel: there nothing
    overlaps, and in prefill steps it was the faster (docs/benchmarks.md)."""
    return x.is_cuda and fits(x, weight, residual) and x.shape[0] <= MAX_ROWS


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """rms_norm(x) or, with a residual, (rms_norm(x + residual), x + residual), as layers/norm.py computes them.
    The result's dtype is that of weight * x (torch's promotion). No host sync: safe inside a CUDA graph."""
    assert fits(x, weight, residual), (f"add_rms_norm takes rows of at most {MAX_HIDDEN} with a matching "
                                       f"weight, got x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = _launch(x, weight, eps, residual, out, None, overlap_options(x.device))
    return out if residual is None else (out, summed)


def add_rms_norm_e4m3(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """(values e4m3 [rows, N], scale float32 [rows, 1], x + residual or None): add_rms_norm's rows (of x's dtype,
    which weight's must be) quantized as kernels/fp8.quantize_rows_e4m3 quantizes them, in the same kernel."""
    assert fits(x, weight, residual) and weight.dtype == x.dtype, (
        f"add_rms_norm_e4m3 takes rows of at most {MAX_HIDDEN} with a weight of their size and dtype, got x "
        f"{tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    values, scale = empty_e4m3_rows(*x.shape, x.device)
    summed = _launch(x, weight, eps, residual, values, scale, dict(OVERLAP=False))
    return values, scale, summed


def _launch(x, weight, eps, residual, out, scale, overlap: dict) -> torch.Tensor | None:
    """Runs the kernel into out (and scale, which asks for e4m3); returns x + residual (None without one)."""
    rows, n = x.shape
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, summed if summed is not None else out,
            scale if scale is not None else weight, x.stride(0), residual.stride(0) if residual is not None else 0,
            n, eps, BLOCK=block, HAS_RESIDUAL=residual is not None, QUANTIZE=scale is not None,
            num_warps=min(max(block // 256, 1), 8), **overlap,
        )
    return summed
