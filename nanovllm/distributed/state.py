"""Tensor-parallel rank and size, read from torch.distributed; rank 0 of 1 when it is not initialised."""

from __future__ import annotations

import torch
import torch.distributed as dist

# the engine's own all-reduce for small CUDA tensors (symmetric_all_reduce.py), set by the model runner
_custom_all_reduce = None


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def set_custom_all_reduce(reducer) -> None:
    """Route the all-reduces it handles to reducer (None: NCCL/gloo for all)."""
    global _custom_all_reduce
    _custom_all_reduce = reducer


def custom_all_reduce():
    """The engine's own all-reduce for small CUDA tensors, or None."""
    return _custom_all_reduce


def min_across_ranks(value: int, device: torch.device) -> int:
    """The smallest of every tensor-parallel rank's value (a collective: every rank must call it); value itself
    without tensor parallelism. device: where the default group's backend takes tensors (CUDA for NCCL)."""
    if tp_size() == 1:
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return int(flag.item())


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel ranks, in place; returns x."""
    if tp_size() > 1:
        if _custom_all_reduce is not None and _custom_all_reduce.handles(x):
            return _custom_all_reduce(x)
        dist.all_reduce(x)
    return x
