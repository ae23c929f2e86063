"""The mixture-of-experts feed-forward in plain torch, expert by expert as transformers computes it: the CPU
path and the oracle of the Triton kernels (kernels/fused_moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
