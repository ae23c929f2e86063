"""One engine's tensor-parallel place: its rank, the number of ranks and their collectives.

Nothing here reads torch.distributed's process-wide state: an engine of one rank makes no collective call, even
in a process where another engine's process group still exists. A model's layers take their engine's
``TensorParallel`` while the model is built (``building_model``) and keep it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist


class TensorParallel:
    """An engine's rank among ``size`` ranks; with size > 1, the collectives go over the default process group,
    which that engine created (distributed/workers.py)."""

    def __init__(self, rank: int = 0, size: int = 1):
        assert 0 <= rank < size
        self.rank = rank
        self.size = size
        # the engine's own all-reduce of small CUDA tensors (symmetric_all_reduce.py), set by its model runner
        self.custom_all_reduce = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        if self.size > 1:
            reducer = self.custom_all_reduce
            if reducer is not None and reducer.handles(x):
                return reducer(x)
            dist.all_reduce(x)
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (a collective: every rank must call it). device: where the group's
        backend takes tensors (CUDA for NCCL)."""
        if self.size == 1:
            return value
        flag = torch.tensor([value], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return int(flag.item())


# the engine whose model is being built in this thread (None: one rank)
_building: ContextVar[TensorParallel | None] = ContextVar("nanovllm_building_tensor_parallel", default=None)


@contextmanager
def building_model(tp: TensorParallel) -> Iterator[None]:
    """Layers built inside take ``tp`` (``current_tensor_parallel``)."""
    token = _building.set(tp)
    try:
        yield
    finally:
        _building.reset(token)


def current_tensor_parallel() -> TensorParallel:
    """The TensorParallel of the model being built; a fresh one-rank one outside ``building_model``."""
    tp = _building.get()
    return tp if tp is not None else TensorParallel()


def tp_rank() -> int:
    return current_tensor_parallel().rank


def tp_size() -> int:
    return current_tensor_parallel().size
