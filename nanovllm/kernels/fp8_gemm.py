"""y = x W^T for quantization="fp8" at a decode step's row counts: e4m3 x with a scale per row, e4m3 W with a
scale per output channel (layers/quantization/fp8.py), the same numbers as torch._scaled_mm:

    y[m, n] = x_scale[m] * w_scale[n] * sum_k x_fp8[m, k] w_fp8[n, k]  (+ bias[n])

At 17-512 rows cuBLAS tiles the product 128 x 128, which leaves most of the GPU idle for the layers with few output
columns (o_proj, down_proj: 4,096 columns are 64 tiles for 132 SMs). Here the tile fits the shape: programs take
BLOCK_M rows by BLOCK_N columns, the programs of one column of tiles next to each other so that their weight tile
is read from HBM once and from L2 after. With SPLIT_K > 1 each tile's K range is shared by that many programs, for
shapes with fewer tiles than SMs: each stores its float32 partial sum, takes a ticket from the tile's counter, and
the last to arrive adds the partials in split order (the result does not depend on which finished first), scales
and stores the tile, and resets the counter (zeros that live as long as the process, as CUDA graphs want).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.jit import INTERPRETED, k_splits, num_sms, split_k_buffers


@triton.jit
def _fp8_gemm_kernel(
    x_desc, w_desc,             # with TMA: descriptors of x [M, K] and w [N, K] in tiles of [BLOCK_*, BLOCK_K]
    x_ptr, w_ptr,               # without: x [M, K] and w [N, K] e4m3, unit stride on K
    y_ptr,                      # [M, N] out dtype
    x_scale_ptr, w_scale_ptr,   # [M], [N] float32
    bias_ptr,                   # [N], read only when HAS_BIAS
    partial_ptr,                # [SPLIT_K, M, N] float32, when SPLIT_K > 1
    counter_ptr,                # [tiles] int32 zeros, when SPLIT_K > 1
    M, N, K,
    x_stride, w_stride, y_stride,
    k_per_split,                # a multiple of BLOCK_K
    split_stride,               # M * N: one split's partials
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    TMA: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = tile % tiles_m, tile // tiles_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):  # K is a multiple of BLOCK_K (fp8_linear checks)
        if TMA:  # rows and columns past the ends read as zeros
            x = x_desc.load([pid_m * BLOCK_M, k])
            w = w_desc.load([pid_n * BLOCK_N, k])
        else:
            x = tl.load(x_ptr + rows[:, None] * x_stride + (k + ks)[None, :], mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptr + cols[:, None] * w_stride + (k + ks)[None, :], mask=col_mask[:, None], other=0.0)
        if UPCAST:  # the interpreter's dot takes no fp8 operands: the same values in float32
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)

    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K > 1:
        here = partial_ptr + rows[:, None] * N + cols[None, :]
        # int64: a prefill's rows times a wide projection's columns pass 2^31 in a few splits
        tl.store(here + tl.program_id(1).to(tl.int64) * split_stride, acc, mask=mask)
        # one thread takes the ticket: the barrier puts every thread's partial stores before its release (acq_rel),
        # so the program drawing the last ticket sees every split's partial
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + tile, 1)
        if ticket == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for _ in range(SPLIT_K):
                acc += tl.load(here, mask=mask, other=0.0, cache_modifier=".cg")
                here += split_stride
            _scale_and_store(acc, y_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, y_stride, rows, cols, row_mask,
                             col_mask, HAS_BIAS)
            tl.store(counter_ptr + tile, 0)
    else:
        _scale_and_store(acc, y_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, y_stride, rows, cols, row_mask, col_mask,
                         HAS_BIAS)


@triton.jit
def _scale_and_store(acc, y_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, y_stride, rows, cols, row_mask, col_mask,
                     HAS_BIAS: tl.constexpr):
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    acc = acc * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = True
    split_k: int = 1  # programs sharing each tile's K range (fewer when K has fewer tiles)


def takes(k: int) -> bool:
    """Whether fp8_linear's default tiling takes an in_features of k (whole tiles of K)."""
    return k % Fp8GemmConfig.block_k == 0


def default_config(m: int, n: int, num_sms: int) -> Fp8GemmConfig:
    """Tiles of 64 rows (one warpgroup's product) by 128 columns, or 64 columns where 128 would leave SMs idle."""
    block_n = 128 if triton.cdiv(m, 64) * triton.cdiv(n, 128) >= num_sms else 64
    return Fp8GemmConfig(block_m=64, block_n=block_n)


def fp8_linear(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """x_fp8 [M, K] (scale [M, 1]) times the e4m3 weight [N, K] (scale per row, N of them) -> [M, N] out_dtype."""
    m, k = x_fp8.shape
    n = weight.shape[0]
    config = config or default_config(m, n, num_sms(x_fp8.device))
    assert weight.shape[1] == k and k % config.block_k == 0, \
        f"fp8_linear takes K a multiple of {config.block_k}; got x {tuple(x_fp8.shape)}, weight {tuple(weight.shape)}"
    assert x_fp8.stride(1) == 1 and weight.stride(1) == 1, "fp8_linear takes unit stride on K"
    y = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return y
    if config.tma:
        x_desc = TensorDescriptor.from_tensor(x_fp8, [config.block_m, config.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    else:
        x_desc = w_desc = None
    split_k, k_per_split = k_splits(k, config.block_k, config.split_k)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    partial, counters = split_k_buffers(split_k, m, n, tiles, unused=y)
    _fp8_gemm_kernel[(tiles, split_k)](
        x_desc, w_desc, x_fp8, weight, y, x_scale, weight_scale, bias if bias is not None else weight_scale,
        partial, counters, m, n, k, x_fp8.stride(0), weight.stride(0), y.stride(0), k_per_split, m * n,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k, TMA=config.tma,
        HAS_BIAS=bias is not None, UPCAST=INTERPRETED, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y
