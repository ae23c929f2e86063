"""y = x W^T for an fp8 checkpoint's block-scaled weights (HF `quant_method: fp8`, `weight_block_size` [128, 128],
as Qwen3-*-FP8): W is e4m3 with one float32 scale per 128 x 128 block (`weight_scale_inv`), x is quantized to e4m3
per token and per group of 128 inputs (dynamic), and each K step's partial product is scaled as it is summed:

    y[m, n] = sum_g x_scale[m, g] * w_scale[n, g] * sum_{k in group g} x_fp8[m, k] * w_fp8[n, k]

w_scale is kept per output row ([N, K / 128]: each block's scale repeated over its 128 rows), so that a layer's
shards (q/k/v, gate/up, tensor-parallel slices) are cut from it as from the weight itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.jit import INTERPRETED

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK_N = 128  # output columns per program


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (e4m3 [rows, cols], float32 scale [rows, cols // group]): a symmetric scale per group of
    `group` consecutive columns of a row (cols a multiple of group)."""
    rows, cols = x.shape
    groups = x.float().view(rows, cols // group, group)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (groups / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(rows, cols), scale.view(rows, -1)


def scale_rows(scale_inv: torch.Tensor, block_n: int, rows: int) -> torch.Tensor:
    """A checkpoint's block scales [ceil(N / bn), K / bk] -> one row per output row [N, K / bk] (float32)."""
    return scale_inv.float().repeat_interleave(block_n, 0)[:rows].contiguous()


def dequantize_rows(weight: torch.Tensor, scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """e4m3 weight [N, K] with scales per row and group of block_k inputs [N, K / block_k] -> float32 [N, K]."""
    return weight.float() * scales.repeat_interleave(block_k, 1)


@triton.jit
def _block_fp8_gemm_kernel(
    x_ptr,              # [M, K] e4m3
    w_ptr,              # [N, K] e4m3
    y_ptr,              # [M, N] out dtype
    x_scale_ptr,        # [M, K // GROUP_K] float32
    w_scale_ptr,        # [N, K // GROUP_K] float32
    M, N, K,
    x_stride, w_stride, y_stride, x_scale_stride, w_scale_stride,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GROUP_K)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, GROUP_K)):
        k = g * GROUP_K + ks
        x = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=row_mask[:, None], other=0.0)
        # w^T tile [GROUP_K, BLOCK_N]
        w = tl.load(w_ptr + cols[None, :] * w_stride + k[:, None], mask=col_mask[None, :], other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        partial = tl.dot(x, w)
        x_scale = tl.load(x_scale_ptr + rows * x_scale_stride + g, mask=row_mask, other=0.0)
        w_scale = tl.load(w_scale_ptr + cols * w_scale_stride + g, mask=col_mask, other=0.0)
        acc += partial * x_scale[:, None] * w_scale[None, :]
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_k: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float) times an e4m3 weight [N, K] with scales per row and group of block_k inputs
    [N, K / block_k] (scale_rows) -> [..., N] in x's dtype. K must be a multiple of block_k; N any size."""
    n, k = weight.shape
    assert k % block_k == 0, f"in_features {k} is not a multiple of the weight block {block_k}"
    assert weight.dtype == FP8_DTYPE and scales.shape == (n, k // block_k) and scales.is_contiguous(), \
        f"weight {weight.dtype} {tuple(weight.shape)} and scales {tuple(scales.shape)} do not match {block_k}"
    rows = x.reshape(-1, k)
    x_fp8, x_scale = quantize_groups(rows, block_k)
    m = rows.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    # UPCAST: the interpreter's dot takes no fp8 operands, so there it multiplies the same values in float32
    _block_fp8_gemm_kernel[grid](
        x_fp8, weight, y, x_scale, scales, m, n, k,
        x_fp8.stride(0), weight.stride(0), y.stride(0), x_scale.stride(0), scales.stride(0),
        GROUP_K=block_k, BLOCK_M=block_m, BLOCK_N=BLOCK_N, UPCAST=INTERPRETED,
        num_warps=4, num_stages=3,
    )
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], n)
