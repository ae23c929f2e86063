"""What the kernels' launchers share: triton.jit for kernels whose small index arguments change from step to step,
whether the interpreter runs them, and how many SMs a launch plans for.

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

# under the CPU interpreter some kernels multiply their 16-bit tiles in float32 (its bfloat16 tl.dot is wrong)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SMs; the interpreter has none, so plan as for an H100/H200 (CPU tests see GPU-like plans)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def jit_unspecialized(*names: str):
    kwargs = {"do_not_specialize": names}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = names
    return triton.jit(**kwargs)
