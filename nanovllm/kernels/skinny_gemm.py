"""y = x W^T for a few rows of x (decode steps of up to 16 requests), optionally with SiLU-and-mul fused in.

With a handful of rows a linear layer only streams its weight, and the whole matrix is a few megabytes: the
time goes to how many SMs read at once, not to arithmetic. Programs tile the output columns (BLOCK_N) and split
the reduction dimension (SPLIT_K) so that about one program runs on every SM; each reads its [BLOCK_N, K / SPLIT_K]
slice of W once. The split partial sums meet in one kernel (no second launch): every split writes its float32
partial, takes a ticket from its column block's counter, and the last to arrive sums the partials in split order
(so the result does not depend on which finished first), applies the epilogue and stores, and resets the counter
for the next call. The counters live as long as the process (zeros, reset by each call), so CUDA graphs replay
the kernel as they captured it.

Launched overlapped with the kernel before it (kernels/jit.py), a program reads the head of its slice of W
before it waits on that kernel: the weight is no product of it, so the read runs under that kernel's tail and
only x waits.

Gated (SwiGLU's gate_up projection packed as [gate | up] rows of W): each program reads the gate and the up rows
of its columns and stores silu(gate) * up, so the activation never makes a round trip through memory.

fp8 (quantization="fp8"): W may be e4m3 with a float32 scale per output row, and x either 16-bit (the weight is
upcast as it loads: half the bytes of a 16-bit weight read) or e4m3 with a scale per row (e4m3 products, as
torch._scaled_mm computes them). The scales multiply the sums before the bias and the activation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.jit import (
    INTERPRETED,
    k_splits,
    num_sms,
    overlap_options,
    split_k_buffers,
    wait_for_prior_kernel,
)

MAX_ROWS = 16  # tl.dot's smallest M; more rows go to the library GEMM
FP8 = torch.float8_e4m3fn
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,              # [M, K], unit stride on K
    w_ptr,              # [N_total, K] contiguous: N rows, or 2N ([gate | up]) when GATED
    bias_ptr,           # [N_total] or unused
    w_scale_ptr,        # [N_total] float32 when W_SCALED (an fp8 weight's scale per output row), else unused
    x_scale_ptr,        # [M] float32 when X_SCALED (an fp8 x's scale per row), else unused
    out_ptr,            # [M, N], unit stride on N
    partial_ptr,        # [SPLIT_K, M, N_out_cols(x2 when GATED)] float32, when SPLIT_K > 1
    counter_ptr,        # [column blocks] int32 zeros, when SPLIT_K > 1
    M, N, K,
    stride_xm, stride_om,
    k_per_split,        # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    W_SCALED: tl.constexpr,
    X_SCALED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    HEAD_K: tl.constexpr,  # K elements of the program's W slice read before waiting on the kernel before (0: none)
    OVERLAP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # W^T's columns: a [BLOCK_K, BLOCK_N] tile loads W's rows

    # The weight does not depend on the kernel before: an overlapped launch reads the head of its slice while
    # that kernel still runs, and only x waits.
    if HEAD_K > 0:
        head_ks = k_start + tl.arange(0, HEAD_K)
        head_k_mask = head_ks < k_end
        head_mask = head_k_mask[:, None] & col_mask[None, :]
        w_head = tl.load(w_cols + head_ks[:, None], mask=head_mask, other=0.0)
        if GATED:
            w_up_head = tl.load(w_cols + N * K + head_ks[:, None], mask=head_mask, other=0.0)
    wait_for_prior_kernel(OVERLAP)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if HEAD_K > 0:
        # its own names: the loop below may not carry a variable whose shape changes
        x_head = tl.load(x_ptr + rows[:, None] * stride_xm + head_ks[None, :],
                         mask=row_mask[:, None] & head_k_mask[None, :], other=0.0)
        if UPCAST:
            x_head = x_head.to(tl.float32)
        acc += tl.dot(x_head, _as_operand(w_head, x_head, UPCAST))
        if GATED:
            acc_up += tl.dot(x_head, _as_operand(w_up_head, x_head, UPCAST))
    for k in range(k_start + HEAD_K, k_end, BLOCK_K):
        k_mask = (k + ks) < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k + ks)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        tile_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_cols + (k + ks)[:, None], mask=tile_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        acc += tl.dot(x, _as_operand(w, x, UPCAST))
        if GATED:
            w_up = tl.load(w_cols + N * K + (k + ks)[:, None], mask=tile_mask, other=0.0)
            acc_up += tl.dot(x, _as_operand(w_up, x, UPCAST))

    if SPLIT_K > 1:
        width = 2 * N if GATED else N
        here = partial_ptr + split * M * width + rows[:, None] * width + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        tl.store(here, acc, mask=mask)
        if GATED:
            tl.store(here + N, acc_up, mask=mask)
        # One thread takes the ticket: the barrier puts every thread's partial stores before its release (acq_rel),
        # so the program drawing the last ticket sees every split's partial.
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + pid_n, 1)
        if ticket == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLIT_K):
                there = partial_ptr + s * M * width + rows[:, None] * width + cols[None, :]
                acc += tl.load(there, mask=mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(there + N, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(acc, acc_up, bias_ptr, w_scale_ptr, x_scale_ptr, out_ptr, stride_om, rows, cols, row_mask,
                      col_mask, N, HAS_BIAS, GATED, W_SCALED, X_SCALED)
            tl.store(counter_ptr + pid_n, 0)
    else:
        _epilogue(acc, acc_up, bias_ptr, w_scale_ptr, x_scale_ptr, out_ptr, stride_om, rows, cols, row_mask,
                  col_mask, N, HAS_BIAS, GATED, W_SCALED, X_SCALED)


@triton.jit
def _as_operand(w, x, UPCAST: tl.constexpr):
    """A loaded weight tile as tl.dot's right operand beside x: float32 under the interpreter, x's dtype when the
    weight is e4m3 and x is not (e4m3 with e4m3 multiplies as it is)."""
    if UPCAST:
        w = w.to(tl.float32)
    elif w.dtype != x.dtype:
        w = w.to(x.dtype)
    return w  # one return: the compiler types a helper by its single result


@triton.jit
def _epilogue(acc, acc_up, bias_ptr, w_scale_ptr, x_scale_ptr, out_ptr, stride_om, rows, cols, row_mask, col_mask,
              N, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, W_SCALED: tl.constexpr, X_SCALED: tl.constexpr):
    if W_SCALED:
        acc *= tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(w_scale_ptr + N + cols, mask=col_mask, other=0.0)[None, :]
    if X_SCALED:
        x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
        acc *= x_scale
        if GATED:
            acc_up *= x_scale
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        # silu and the product in float32, as silu_and_mul computes them from the rounded projection
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32) * up
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    # K elements of each program's slice of W read before the kernel waits on the one before it (a power of two
    # and a multiple of block_k); None: prefetch_k's rule (by the slice, PREFETCH_BYTES and the weight's size), 0: none
    prefetch_k: int | None = None


# what a program reads of W before its wait, counted as 16-bit values (an e4m3 tile is upcast for the product):
# registers it holds until x arrives
PREFETCH_BYTES = 32 << 10
# the read before the wait paid for weights up to this size and not beyond (docs/benchmarks.md, 2026-12-07)
PREFETCH_MAX_WEIGHT_BYTES = 8 << 20


def prefetch_k(config: SkinnyConfig, k_per_split: int, gated: bool, weight_bytes: int = 0) -> int:
    """The head of each program's slice read before the wait: config.prefetch_k; else none for a weight of more
    than PREFETCH_MAX_WEIGHT_BYTES (weight_bytes in all), or the largest power-of-two multiple of block_k within
    both the slice and PREFETCH_BYTES."""
    if config.prefetch_k is not None:
        head = config.prefetch_k
        assert head == 0 or (head % config.block_k == 0 and head & (head - 1) == 0), (
            f"prefetch_k is 0 or a power-of-two multiple of block_k ({config.block_k}), got {head}")
        return head
    if weight_bytes > PREFETCH_MAX_WEIGHT_BYTES:
        return 0
    limit = min(k_per_split, PREFETCH_BYTES // (config.block_n * 2 * (2 if gated else 1)))
    if limit < config.block_k:
        return 0
    head = config.block_k
    while head * 2 <= limit:
        head *= 2
    return head


def default_config(n: int, k: int, device: torch.device, gated: bool = False, weight_bytes: int = 2) -> SkinnyConfig:
    """Column blocks of 32, and K splits for about two programs per SM (one when gated: each reads two rows of
    W a column), each split >= one K tile (see docs/benchmarks.md for the sweep these come from). A weight of
    weight_bytes per element takes tiles of as many bytes as a 16-bit one's: an e4m3 tile is twice as long."""
    block_n, block_k = 32, (256 if gated else 128) * 2 // weight_bytes
    column_blocks = triton.cdiv(n, block_n)
    per_sm = 1 if gated else 2
    split_k = max(1, min(round(per_sm * num_sms(device) / column_blocks), k // block_k, 16))
    return SkinnyConfig(block_n, block_k, split_k)


# the library GEMM keeps larger weights: from ~8 MiB on it reads at a higher bandwidth than these tiles
# (Qwen3-8B's projections, H200), while the fused SiLU-and-mul saves a kernel at every size
MAX_UNGATED_WEIGHT_BYTES = 8 << 20


def takes(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether a linear layer should run this product here rather than in the library GEMM. An e4m3 weight's
    alternative, quantized activations through torch._scaled_mm, is slower at every size at these rows."""
    return x.is_cuda and fits(x, weight) and (gated or weight.dtype == FP8 or weight.numel() * weight.element_size()
                                              <= MAX_UNGATED_WEIGHT_BYTES)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear takes this product (otherwise the library GEMM should): 16-bit x with a weight of its
    dtype or e4m3, or e4m3 x with an e4m3 weight."""
    dtypes_fit = (x.dtype in SIXTEEN_BIT and weight.dtype in (x.dtype, FP8)) or x.dtype == weight.dtype == FP8
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and dtypes_fit and weight.is_contiguous()
            and x.stride(-1) == 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False,
                  config: SkinnyConfig | None = None, weight_scale: torch.Tensor | None = None,
                  x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M <= 16, K] @ weight[N_total, K]^T (+ bias); gated: weight is [gate | up] (2N rows), returns
    silu(x gate^T) * (x up^T) as [M, N]. An e4m3 weight comes with weight_scale (float32, one per row of weight),
    an e4m3 x with x_scale (float32, one per row of x) and out_dtype (the 16-bit dtype of the result)."""
    assert fits(x, weight), (f"skinny_linear takes <= {MAX_ROWS} rows of 16-bit or e4m3 x, got {tuple(x.shape)} "
                             f"{x.dtype} with a {weight.dtype} weight")
    assert (weight.dtype == FP8) == (weight_scale is not None), "an e4m3 weight and weight_scale go together"
    assert (x.dtype == FP8) == (x_scale is not None), "an e4m3 x and x_scale go together"
    out_dtype = out_dtype or x.dtype
    assert out_dtype in SIXTEEN_BIT, f"skinny_linear returns bfloat16 or float16, not {out_dtype}"
    m, k = x.shape
    n_total, k_w = weight.shape
    assert k_w == k, f"weight has {k_w} input features, x has {k}"
    n = n_total // 2 if gated else n_total
    assert not gated or n_total % 2 == 0, f"a gated weight has an even number of rows, got {n_total}"
    config = config or default_config(n, k, x.device, gated, weight.element_size())
    split_k, k_per_split = k_splits(k, config.block_k, config.split_k)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    column_blocks = triton.cdiv(n, config.block_n)
    partial, counters = split_k_buffers(split_k, m, n_total, column_blocks, unused=out)
    _skinny_gemm_kernel[(column_blocks, split_k)](
        x, weight, bias if bias is not None else out, out if weight_scale is None else weight_scale.reshape(-1),
        out if x_scale is None else x_scale.reshape(-1), out, partial, counters, m, n, k, x.stride(0),
        out.stride(0), k_per_split, HAS_BIAS=bias is not None, GATED=gated, W_SCALED=weight_scale is not None,
        X_SCALED=x_scale is not None, SPLIT_K=split_k, BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, UPCAST=INTERPRETED,
        HEAD_K=prefetch_k(config, k_per_split, gated, weight.numel() * weight.element_size()), num_warps=config.num_warps,
        num_stages=config.num_stages, **overlap_options(x.device),
    )
    return out
