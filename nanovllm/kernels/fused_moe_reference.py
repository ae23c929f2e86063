"""The mixture-of-experts feed-forward in plain torch, expert by expert as transformers computes it: the CPU
path and the oracle of the Triton kernels (kernels/fused_moe.py); and the sorting of assignments by expert."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class MoeAlignment(NamedTuple):
    sorted_ids: torch.Tensor     # [max_padded] int32: assignment ids grouped by expert, sentinel = num_assignments
    block_experts: torch.Tensor  # [max_padded // block_m] int32: the expert of each row block
    num_padded: torch.Tensor     # [1] int32: rows in use (a multiple of block_m); later blocks do nothing


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Worst case of the padded total: every expert that is hit pads up to block_m - 1 rows."""
    padded = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-padded // block_m) * block_m


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the assignments by expert (stable), each expert's run padded to block_m, in torch ops: the oracle
    of the kernels' ``moe_align`` (no host sync either, but some thirty small launches).

    topk_ids: [num_tokens, top_k] integer expert ids.
    """
    assert topk_ids.dim() == 2, f"topk_ids must be [num_tokens, top_k], got {tuple(topk_ids.shape)}"
    device = topk_ids.device
    experts = topk_ids.flatten().long()  # [assignments]
    num_assignments = experts.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    order = torch.sort(experts, stable=True).indices  # assignment ids, expert by expert
    sorted_experts = experts[order]
    rank_in_expert = torch.arange(num_assignments, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    rows = (padded_ends - padded_counts)[sorted_experts] + rank_in_expert
    max_rows = max_padded_rows(num_assignments, num_experts, block_m)
    sorted_ids = torch.full((max_rows,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids[rows] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return MoeAlignment(sorted_ids, block_experts.to(torch.int32), padded_ends[-1:].to(torch.int32))


def check_moe_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> None:
    """The shapes, dtypes and devices both implementations take (see ``fused_moe``)."""
    assert hidden.dim() == 2, f"hidden must be [num_tokens, hidden], got {tuple(hidden.shape)}"
    num_tokens, hidden_size = hidden.shape
    assert w13.dim() == 3 and w13.shape[2] == hidden_size and w13.shape[1] % 2 == 0, \
        f"w13 must be [experts, 2 * intermediate, {hidden_size}], got {tuple(w13.shape)}"
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    assert w2.shape == (num_experts, hidden_size, intermediate), \
        f"w2 must be [{num_experts}, {hidden_size}, {intermediate}], got {tuple(w2.shape)}"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == num_tokens, \
        f"topk_ids must be [{num_tokens}, top_k], got {tuple(topk_ids.shape)}"
    assert topk_weights.shape == topk_ids.shape, \
        f"topk_weights {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}"
    assert not topk_ids.is_floating_point(), f"topk_ids must be integers, got {topk_ids.dtype}"
    assert hidden.dtype == w13.dtype == w2.dtype, f"dtypes differ: {hidden.dtype}, {w13.dtype}, {w2.dtype}"
    assert hidden.device == w13.device == w2.device == topk_ids.device == topk_weights.device


def fused_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """The same as ``fused_moe`` in plain torch, one expert at a time in expert order (as transformers)."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    assignments = topk_ids.flatten().long()
    order = torch.sort(assignments, stable=True).indices
    counts = torch.bincount(assignments, minlength=num_experts).tolist()
    weights = topk_weights.flatten()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        chosen = order[start:start + count]
        start += count
        tokens = chosen // top_k
        gate_up = F.linear(hidden[tokens], w13[expert])
        activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        expert_out = F.linear(activated, w2[expert]) * weights[chosen, None]
        out.index_add_(0, tokens, expert_out.to(out.dtype))
    return out
