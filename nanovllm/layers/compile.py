"""torch.compile for the small elementwise ops (norms, RoPE, SiLU-and-mul), on CUDA only.

Eager, each of these is a handful of tiny kernels per layer; compiled, one fused kernel. CPU calls stay
eager (compiling there needs a C++ toolchain and minutes of start-up for little gain). NANOVLLM_NO_COMPILE=1
keeps everything eager: the engine config reads it once (``EngineConfig.compile_small_ops``), and a layer built
inside ``building_compiled(False)`` takes its op's eager form (``eager_unless_compiling``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_compiling: ContextVar[bool] = ContextVar("nanovllm_compile_small_ops", default=True)


@contextmanager
def building_compiled(enabled: bool) -> Iterator[None]:
    """Layers built inside use their ops compiled on CUDA (``enabled``) or always eager."""
    token = _compiling.set(enabled)
    try:
        yield
    finally:
        _compiling.reset(token)


def eager_unless_compiling(op):
    """``op`` (a ``cuda_compiled`` function) for a layer being built: itself, or its eager form when the model
    being built does not compile (``building_compiled``)."""
    return op if _compiling.get() else op.__wrapped__


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
        if args[0].is_cuda:
            if compiled is None:
                _raise_recompile_limit()
                compiled = torch.compile(fn, dynamic=True)
            return compiled(*args)
        return fn(*args)

    return wrapper
