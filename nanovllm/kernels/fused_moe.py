"""Mixture-of-experts feed-forward: tokens sorted by expert, grouped GEMMs over stacked expert weights.

Each token picked ``top_k`` experts; one (token, expert) pair is an *assignment*, numbered
``token * top_k + slot``. The assignments are sorted by expert and each expert's run padded to a multiple of
BLOCK_M, so one program's rows all use one expert's weights:

```
sorted_ids:   [a3 a7 a9 -- | a0 a4 -- -- | a1 a2 a5 a6 | ...]   (-- = the sentinel num_assignments)
block_expert: [   e0       |    e2       |     e5      | ...]
```

Then two grouped GEMMs: gate/up with SiLU(gate) * up fused into its epilogue -> [assignments, I], and down with
the routing weight applied -> [assignments, H]; the sum over each token's top_k rows ends it. Every shape
depends only on the number of tokens (the padding is sized for the worst case), the expert counts stay on the
device, and programs past the padded total return at once: safe inside a CUDA graph.

``fused_moe_reference.py`` holds the same computation in plain torch (no Triton needed): the CPU path and the
oracle of these kernels.
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fused_moe_reference import MoeAlignment, check_moe_args, max_padded_rows

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_moe_table.json")


class MoeBlockConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_block_config(num_tokens: int) -> MoeBlockConfig:
    """Without a tuned entry: small row blocks at decode sizes (a weight read), larger tiles for prefill."""
    if num_tokens <= 32:
        return MoeBlockConfig(16, 64, 128, 4, 3)
    if num_tokens <= 512:
        return MoeBlockConfig(32, 64, 64, 4, 3)
    return MoeBlockConfig(64, 128, 64, 8, 3)


def table_key(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype) -> str:
    """One shape's key in the table: experts, the (per-rank) intermediate size, hidden size, dtype."""
    return f"E={num_experts},I={intermediate},H={hidden},dtype={str(dtype).removeprefix('torch.')}"


@functools.cache
def _load_table(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def pick_block_config(num_tokens: int, num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype,
                      device_name: str, table_path: str = TABLE_PATH) -> MoeBlockConfig:
    """The tuned configuration of the nearest batch size at or above num_tokens (else the largest tuned);
    the default heuristic where the table has no entry for this device and shape.

    Table layout (written by benchmarks/tune_fused_moe.py): {device name: {table_key: {batch size: [block_m,
    block_n, block_k, num_warps, num_stages]}}}.
    """
    entries = _load_table(table_path).get(device_name, {}).get(table_key(num_experts, intermediate, hidden, dtype))
    if not entries:
        return default_block_config(num_tokens)
    sizes = sorted(int(size) for size in entries)
    size = next((s for s in sizes if s >= num_tokens), sizes[-1])
    return MoeBlockConfig(*entries[str(size)])


@triton.jit
def _moe_count_kernel(
    topk_ids_ptr,        # [num_assignments] expert of each assignment
    chunk_counts_ptr,    # [num_chunks, num_experts] int32 out: assignments of each expert in each chunk
    rank_ptr,            # [num_assignments] int32 out: rank among the chunk's earlier assignments of its expert
    num_assignments, num_experts,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_assignments
    experts = tl.load(topk_ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    # stable rank within the chunk: earlier assignments (j < i) of the same expert
    same = (experts[:, None] == experts[None, :]) & (tl.arange(0, CHUNK)[None, :] < tl.arange(0, CHUNK)[:, None])
    tl.store(rank_ptr + offs, tl.sum(same.to(tl.int32), axis=1), mask=mask)
    expert_range = tl.arange(0, BLOCK_E)
    counts = tl.sum((experts[:, None] == expert_range[None, :]).to(tl.int32), axis=0)  # padding rows are -1
    tl.store(chunk_counts_ptr + chunk * num_experts + expert_range, counts, mask=expert_range < num_experts)


@triton.jit
def _moe_offsets_kernel(
    chunk_counts_ptr,    # [num_chunks, num_experts] in: counts; out: each chunk's first rank within its expert
    expert_starts_ptr,   # [num_experts] int32 out: the expert's first padded row
    sorted_ids_ptr,      # [max_rows] int32 out: all set to the sentinel here, the real rows by the scatter kernel
    block_experts_ptr,   # [max_rows // BLOCK_M] int32 out
    num_padded_ptr,      # [1] int32 out
    num_chunks, num_experts, num_assignments, max_rows,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
    CHUNKS_PER_STEP: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr, FILL: tl.constexpr,
):
    expert_range = tl.arange(0, BLOCK_E)
    expert_mask = expert_range < num_experts
    chunk_range = tl.arange(0, CHUNKS_PER_STEP)
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for first in range(0, num_chunks, CHUNKS_PER_STEP):  # exclusive prefix over the chunks, a tile at a time
        offs = (first + chunk_range)[:, None] * num_experts + expert_range[None, :]
        mask = ((first + chunk_range) < num_chunks)[:, None] & expert_mask[None, :]
        counts = tl.load(chunk_counts_ptr + offs, mask=mask, other=0)
        tl.store(chunk_counts_ptr + offs, tl.cumsum(counts, axis=0) - counts + running[None, :], mask=mask)
        running += tl.sum(counts, axis=0)
    padded = (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(expert_starts_ptr + expert_range, ends - padded, mask=expert_mask)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    fill = tl.arange(0, FILL)
    for start in range(0, max_rows, FILL):
        tl.store(sorted_ids_ptr + start + fill, tl.full((FILL,), 0, tl.int32) + num_assignments,
                 mask=start + fill < max_rows)
    block_range = tl.arange(0, BLOCKS_PER_STEP)
    num_blocks = max_rows // BLOCK_M
    for first in range(0, num_blocks, BLOCKS_PER_STEP):
        # a block's expert: how many experts' padded runs end at or before its first row
        blocks = first + block_range
        ended = tl.sum(((ends[None, :] <= (blocks * BLOCK_M)[:, None]) & expert_mask[None, :]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.minimum(ended, num_experts - 1), mask=blocks < num_blocks)


@triton.jit
def _moe_scatter_kernel(
    topk_ids_ptr, chunk_counts_ptr, rank_ptr, expert_starts_ptr,
    sorted_ids_ptr,      # [max_rows] int32: row of each assignment = its expert's start + its rank in the expert
    num_assignments, num_experts,
    CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_assignments
    experts = tl.load(topk_ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    rank = tl.load(rank_ptr + offs, mask=mask, other=0)
    before = tl.load(chunk_counts_ptr + chunk * num_experts + experts, mask=mask, other=0)
    start = tl.load(expert_starts_ptr + experts, mask=mask, other=0)
    tl.store(sorted_ids_ptr + start + before + rank, offs.to(tl.int32), mask=mask)


ALIGN_CHUNK = 128  # assignments per program of the counting and scatter kernels


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the assignments by expert (stable), each expert's run padded to block_m: three small kernels.

    topk_ids: [num_tokens, top_k] integer expert ids. No host sync; shapes depend only on num_tokens, so it
    can be captured in a CUDA graph. Equal to ``moe_align_reference``.
    """
    assert topk_ids.dim() == 2, f"topk_ids must be [num_tokens, top_k], got {tuple(topk_ids.shape)}"
    assert not topk_ids.is_floating_point(), f"topk_ids must be integers, got {topk_ids.dtype}"
    device = topk_ids.device
    experts = topk_ids.reshape(-1).contiguous()
    num_assignments = experts.numel()
    num_chunks = triton.cdiv(num_assignments, ALIGN_CHUNK)
    max_rows = max_padded_rows(num_assignments, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    chunk_counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(num_assignments, dtype=torch.int32, device=device)
    expert_starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_rows // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _moe_count_kernel[(num_chunks,)](experts, chunk_counts, rank, num_assignments, num_experts,
                                     CHUNK=ALIGN_CHUNK, BLOCK_E=block_e)
    _moe_offsets_kernel[(1,)](chunk_counts, expert_starts, sorted_ids, block_experts, num_padded,
                              num_chunks, num_experts, num_assignments, max_rows,
                              BLOCK_M=block_m, BLOCK_E=block_e, CHUNKS_PER_STEP=max(16, 8192 // block_e),
                              BLOCKS_PER_STEP=max(16, 8192 // block_e), FILL=1024)
    _moe_scatter_kernel[(num_chunks,)](experts, chunk_counts, rank, expert_starts, sorted_ids,
                                       num_assignments, num_experts, CHUNK=ALIGN_CHUNK)
    return MoeAlignment(sorted_ids, block_experts, num_padded)


@triton.jit
def _moe_grouped_gemm_kernel(
    a_ptr,               # [rows of A, K]: hidden states (gate/up: row = assignment // top_k) or the activations
    b_ptr,               # [num_experts, N (x2 when GATED: gate rows, then up rows), K]
    c_ptr,               # [num_assignments, N]
    routing_weights_ptr,  # [num_assignments] (read when WEIGHTED)
    sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
    N, K, num_assignments, assignments_per_a_row,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,      # c = silu(A @ B_gate^T) * (A @ B_up^T), B_up = rows N..2N of B
    WEIGHTED: tl.constexpr,   # c *= routing weight of the row's assignment
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the padded total: this worst-case-sized grid has more blocks than the step needs
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    valid = ids < num_assignments
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    a_rows = (ids // assignments_per_a_row).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        a = a.to(b.dtype)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:
        weight = tl.load(routing_weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + ids[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alignment: MoeAlignment,
                  assignments_per_a_row: int, routing_weights: torch.Tensor | None, gated: bool,
                  config: MoeBlockConfig) -> None:
    num_assignments, n = out.shape
    k = a.shape[1]
    grid = (alignment.block_experts.numel(), triton.cdiv(n, config.block_n))
    _moe_grouped_gemm_kernel[grid](
        a, b, out, routing_weights if routing_weights is not None else out, alignment.sorted_ids,
        alignment.block_experts, alignment.num_padded,
        n, k, num_assignments, assignments_per_a_row,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GATED=gated, WEIGHTED=routing_weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeBlockConfig | None = None) -> torch.Tensor:
    """sum over each token's experts e of weight_e * down_e(silu(gate_e(x)) * up_e(x)), on Triton.

    hidden: [num_tokens, hidden]; w13: [experts, 2 * intermediate, hidden] (gate rows, then up rows);
    w2: [experts, hidden, intermediate]; topk_weights / topk_ids: [num_tokens, top_k].
    config: block sizes (default: the tuned table for this device, else the heuristic). Returns [num_tokens, hidden].
    """
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    assert hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "the reduced dimension must be contiguous"
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if config is None:
        device_name = torch.cuda.get_device_name(hidden.device) if hidden.is_cuda else "cpu"
        config = pick_block_config(num_tokens, num_experts, intermediate, hidden_size, hidden.dtype, device_name)
    num_assignments = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    alignment = moe_align(topk_ids, num_experts, config.block_m)
    activations = torch.empty(num_assignments, intermediate, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, activations, alignment, top_k, None, gated=True, config=config)
    expert_out = torch.empty(num_assignments, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(activations, w2, expert_out, alignment, 1, topk_weights.flatten().contiguous(), gated=False,
                  config=config)
    return expert_out.view(num_tokens, top_k, hidden_size).sum(dim=1)
