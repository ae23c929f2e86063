"""All-reduce of small tensors through peer-to-peer GPU memory (torch's symmetric memory), for decode steps.

A decode step of a tensor-parallel model all-reduces two [batch, hidden] tensors a layer. At those sizes
NCCL's ring costs ~37 us for 2 MB on two H200s, a two-shot all-reduce that reads the peers' buffers over
NVLink ~13 us (docs/benchmarks.md). Every rank maps one buffer of each peer's at start; the two-shot
operation reduces a tensor in that buffer in place (each rank sums its share from all peers, then writes it to
every peer). A row-parallel layer computes its partial sum straight into the buffer and reads the sum from it
(``shared_output``, ``reduce_shared``); any other caller's tensor is copied in and the sum copied back, as
NCCL's in-place all-reduce would leave it. Tensors larger than the buffer (prefill chunks) go to NCCL, and so
does everything across machines (no peer access: ``create`` returns None).

Only torch's two-shot operation is used: no NVLink multicast. Every rank takes the same path for a tensor
(the choice depends on its shape and dtype alone), or the collective would wait forever.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# torch keeps a group's symmetric-memory setup by the group's name, and a process group created after an earlier
# one was destroyed gets the same name: a second rendezvous in this process would then wait forever on the old
# group's store while fresh worker processes use the new one (seen: a second tensor-parallel engine in one
# process hung). So a process sets it up once; later engines in it all-reduce through NCCL.
_set_up_in_this_process = False

DEFAULT_MAX_BYTES = 8 << 20  # two-shot beat NCCL up to 1024 x 4096 bf16 (8 MiB) in the measurement
_ALIGN_ELEMENTS = 16  # the operation splits the tensor into per-rank shares of 16-byte vectors


class SymmetricAllReduce:
    def __init__(self, buffer: torch.Tensor, group_name: str, world_size: int):
        self.buffer = buffer
        self.group_name = group_name
        self.world_size = world_size

    @classmethod
    def create(cls, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> SymmetricAllReduce | None:
        """A collective over the default group: every rank gets one, or every rank gets None (NCCL then)."""
        global _set_up_in_this_process
        world = dist.get_world_size()
        # decided together before any rendezvous: a rank that skipped it would leave the others waiting
        if not _all_ranks_agree(not _set_up_in_this_process, device):
            log.warning("peer-to-peer all-reduce is set up once per process (an earlier engine here used it); "
                        "this engine all-reduces through NCCL")
            return None
        _set_up_in_this_process = True
        buffer, group_name, reason = None, dist.group.WORLD.group_name, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_"):
                raise RuntimeError("torch has no symm_mem.two_shot_all_reduce_")
            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, group_name)
        except Exception as exc:  # an older torch, no peer access: NCCL does the work
            reason, buffer = f"{type(exc).__name__}: {exc}", None
        if not _all_ranks_agree(buffer is not None, device):
            log.warning("symmetric-memory all-reduce unavailable, using NCCL%s", f" ({reason})" if reason else "")
            return None
        fast = cls(buffer, group_name, world)
        if not _all_ranks_agree(fast._probe(device), device):
            log.warning("symmetric-memory all-reduce gave a wrong sum in its self-test; using NCCL")
            return None
        return fast

    def handles(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.is_contiguous() and self._fits(x.numel(), x.dtype)

    def _fits(self, numel: int, dtype: torch.dtype) -> bool:
        # torch's operation takes float32 and bfloat16 only
        return (dtype in (torch.bfloat16, torch.float32) and numel * dtype.itemsize <= self.buffer.numel()
                and numel % (_ALIGN_ELEMENTS * self.world_size) == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (as dist.all_reduce); x must be one that handles() accepts."""
        shared = self.shared_output(x.shape, x.dtype)
        shared.copy_(x)
        x.copy_(self.reduce_shared(shared))
        return x

    def shared_output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A view of the shared buffer to compute a partial sum into (None if it would not be handled)."""
        numel = math.prod(shape)
        if not self._fits(numel, dtype):
            return None
        return self.buffer[: numel * dtype.itemsize].view(dtype).view(shape)

    def reduce_shared(self, shared: torch.Tensor) -> torch.Tensor:
        """Sum a shared_output() view over the ranks in place. The sum stays valid until the next all-reduce
        overwrites the buffer: read it before then (the decoder's residual add + norm does)."""
        torch.ops.symm_mem.two_shot_all_reduce_(shared, "sum", self.group_name)
        return shared

    def _probe(self, device: torch.device) -> bool:
        rank = dist.get_rank()
        x = torch.full((4, 1024), float(rank + 1), dtype=torch.bfloat16, device=device)
        try:
            self(x)
            torch.cuda.synchronize(device)
        except Exception as exc:
            log.warning("symmetric-memory all-reduce failed its self-test: %s", exc)
            return False
        return bool((x == self.world_size * (self.world_size + 1) / 2).all())

    def close(self) -> None:
        self.buffer = None


def _all_ranks_agree(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # over the default group, as the operation itself
    return bool(flag.item())
