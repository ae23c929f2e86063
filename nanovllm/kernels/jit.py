"""What the kernels' launchers share: triton.jit for kernels whose small index arguments change from step to step,
whether the interpreter runs them, how many SMs a launch plans for, and overlapped (programmatic dependent)
launches.

Triton compiles a variant of a kernel per "specialization" of its arguments: an integer equal to 1 or divisible
by 16, a pointer aligned to 16 bytes. A step's block tables and sequence lengths are slices of one packed
buffer, so their alignment and the table's row stride change with the batch; left specialized, a new variant
compiles (~0.5 s) the first time a batch shows a new combination, in the middle of serving. Listing those
arguments here gives each kernel one variant for them; the large tensors (queries, cache) keep their fast path.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

# under the CPU interpreter some kernels multiply their 16-bit tiles in float32 (its bfloat16 tl.dot is wrong)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SMs; the interpreter has none, so plan as for an H100/H200 (CPU tests see GPU-like plans)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def k_splits(k: int, block_k: int, wanted: int) -> tuple[int, int]:
    """(splits, k_per_split): K shared by up to `wanted` programs in whole tiles of block_k (fewer programs when K has
    fewer tiles); the last split may be shorter."""
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), max(1, wanted)) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


@functools.cache
def ticket_counters(device: torch.device, size: int) -> torch.Tensor:
    """The split-K kernels' ticket counters (one per output tile): zeros, and every launch leaves them zero, so
    kernels in one stream may share them and CUDA graphs replay them as captured."""
    return torch.zeros(size, dtype=torch.int32, device=device)


def split_k_buffers(splits: int, rows: int, cols: int, tiles: int,
                    unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K launch's float32 partials [splits, rows, cols] and ticket counters (one per tile); `unused` for
    both when there is one split (its kernel reads neither)."""
    if splits == 1:
        return unused, unused
    partial = torch.empty((splits, rows, cols), dtype=torch.float32, device=unused.device)
    return partial, ticket_counters(unused.device, tiles)


def jit_unspecialized(*names: str):
    kwargs = {"do_not_specialize": names}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = names
    return triton.jit(**kwargs)


@functools.cache
def overlaps_launches(device: torch.device) -> bool:
    """Whether kernels on this device launch with programmatic dependent launch (Hopper and later): each one
    is scheduled while the kernel before it still runs and waits on the device (``wait_for_prior_kernel``) rather
    than behind the launch's own latency. Inside a CUDA graph the wait is a graph edge."""
    if INTERPRETED or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return hasattr(tl.extra, "cuda") and hasattr(tl.extra.cuda, "gdc_wait")


def overlap_options(device: torch.device) -> dict:
    """Launch keywords of a kernel that calls ``wait_for_prior_kernel(OVERLAP)`` first: its OVERLAP constexpr,
    and the launch attribute that goes with it."""
    if overlaps_launches(device):
        return {"OVERLAP": True, "launch_pdl": True}
    return {"OVERLAP": False}


@triton.jit
def wait_for_prior_kernel(OVERLAP: tl.constexpr):
    """First thing a kernel launched with ``overlap_options`` does: wait until the kernel before it in the stream
    has finished and its writes are visible (every load and store comes after this), then let the next kernel
    be scheduled. No-op when OVERLAP is off."""
    if OVERLAP:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
