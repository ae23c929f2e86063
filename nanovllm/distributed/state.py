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


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel ranks, in place; returns x."""
    if tp_size() > 1:
        if _custom_all_reduce is not None and _custom_all_reduce.handles(x):
            return _custom_all_reduce(x)
        dist.all_reduce(x)
    return x
