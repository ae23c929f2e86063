"""torch.compile for the small elementwise ops (norms, RoPE, SiLU-and-mul), on CUDA only.

Eager, each of these is a handful of tiny kernels per layer; compiled, one fused kernel. CPU calls stay
eager (compiling there needs a C++ toolchain and minutes of start-up for little gain). Set
NANOVLLM_NO_COMPILE=1 to keep everything eager.
"""

from __future__ import annotations

import functools
import os

import torch


def cuda_compiled(fn):
    """Run fn compiled when its first argument is a CUDA tensor, else as it is."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args):
        nonlocal compiled
        if args[0].is_cuda and os.environ.get("NANOVLLM_NO_COMPILE") != "1":
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            return compiled(*args)
        return fn(*args)

    return wrapper
