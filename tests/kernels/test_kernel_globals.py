"""Compiled Triton kernels may read only constexpr globals; the interpreter (which CI runs) reads any, so a plain
float global passes every CPU test and fails to compile on a GPU. This checks every kernel module statically."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest
import triton
import triton.language as tl

import nanovllm.kernels

KERNEL = triton.runtime.jit.KernelInterface  # a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1
ALLOWED = (tl.constexpr, types.ModuleType, KERNEL, type)


def jit_functions():
    for info in pkgutil.iter_modules(nanovllm.kernels.__path__):
        module = importlib.import_module(f"nanovllm.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, KERNEL) and value.fn.__module__ == module.__name__:
                yield pytest.param(value, id=f"{info.name}.{name}")


def bad_globals(fn: KERNEL) -> list[str]:
    code, namespace = fn.fn.__code__, fn.fn.__globals__
    names = set(code.co_names)
    for const in code.co_consts:  # names read in nested code (comprehensions)
        if isinstance(const, types.CodeType):
            names |= set(const.co_names)
    return [f"{name} = {namespace[name]!r}" for name in sorted(names)
            if name in namespace and not isinstance(namespace[name], ALLOWED) and not callable(namespace[name])]


@pytest.mark.parametrize("fn", list(jit_functions()))
def test_kernels_read_only_constexpr_globals(fn):
    assert bad_globals(fn) == [], f"{fn.fn.__name__} reads non-constexpr globals"


def test_the_check_sees_a_float_global():
    namespace = {"tl": tl, "LIMIT": 448.0}
    exec("def kernel(x):\n    return tl.minimum(x, LIMIT)\n", namespace)
    # the check reads only the decorated function (compiled Triton refuses to decorate one made by exec)
    assert bad_globals(types.SimpleNamespace(fn=namespace["kernel"])) == ["LIMIT = 448.0"]
