"""torch.compile for the small elementwise ops (norms, RoPE, SiLU-and-mul), on CUDA only.

Eager, each of these is a handful of tiny kernels per layer; compiled, one fused kernel. CPU calls stay
eager (compiling there needs a C++ toolchain and minutes of start-up for little gain). Set
NANOVLLM_NO_COMPILE=1 to keep everything eager.
"""

from __future__ import annotations

import functools
import os

import torch


def _raise_recompile_limit() -> None:
    # Each engine in a process (dtype, hidden size, eps) adds variants; the default limit of 8 is soon hit.
    import torch._dynamo.config as dynamo_config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))


def cuda_compiled(fn):
    """Run fn compiled when its first argument is a CUDA tensor, else as it is."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args):
        nonlocal compiled
        if args[0].is_cuda and os.environ.get("NANOVLLM_NO_COMPILE") != "1":
            if compiled is None:
                _raise_recompile_limit()
                compiled = torch.compile(fn, dynamic=True)
            return compiled(*args)
        return fn(*args)

    return wrapper
