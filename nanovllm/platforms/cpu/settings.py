"""The CPU's choices, read once from the machine and the environment into the engine config (EngineConfig.cpu):
which dtype pays, whether the 4/8-bit block kernels and the int8 tiles run here, and the NANOVLLM_CPU_* knobs."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from nanovllm.platforms.cpu import cpu_ops

# how a CPU linear layer multiplies (platforms/cpu/linear.py): float = F.linear on the float weight, packed =
# oneDNN's packed copy, fp16 = fbgemm's float16 weights, int8 = int8 weights, blocks = 4/8-bit weight blocks
CPU_LINEAR_METHODS = ("float", "packed", "fp16", "int8", "blocks")


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX). Without it bf16 matmuls run
    through conversions and are several times slower than float32, so float32 is the CPU's default there."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check is not None and check() for check in checks)


def forced_cpu_dtype() -> torch.dtype | None:
    """NANOVLLM_CPU_DTYPE=float32 (or bfloat16): the dtype `auto` takes on the CPU (the test suite pins float32:
    its oracle is transformers in float32); None when unset."""
    forced = os.environ.get("NANOVLLM_CPU_DTYPE")
    if not forced:
        return None
    if forced not in ("float32", "bfloat16"):
        raise ValueError(f"NANOVLLM_CPU_DTYPE must be float32 or bfloat16, got {forced!r}.")
    return getattr(torch, forced)


def default_cpu_dtype() -> torch.dtype:
    """The dtype of a CPU model without the block kernels: NANOVLLM_CPU_DTYPE when set, else bfloat16 where the CPU
    has native bf16 matmuls, float32 elsewhere."""
    forced = forced_cpu_dtype()
    if forced is not None:
        return forced
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def blocks_available() -> bool:
    """Whether the 4/8-bit block kernels (cpu_ops.linear_blocks) run here with SIMD: the compiled ops load and
    have AVX2 or AVX512-VNNI (the plain C loop is correct but slower than float32)."""
    lib = cpu_ops.load()
    return lib is not None and lib.linear_blocks_simd() >= 1


def int8_tiles_wanted() -> bool:
    """Whether cpu_int8's steps of many rows multiply through the compiled tiles (linear_i8's numbers) rather than
    fbgemm (a row or two take linear_i8 either way): NANOVLLM_CPU_INT8_TILES=1 or 0 decides; by default where this
    build has AVX512-VNNI (elsewhere the tiles run a plain C loop, correct but slow)."""
    forced = os.environ.get("NANOVLLM_CPU_INT8_TILES", "auto")
    if forced not in ("auto", "0", "1"):
        raise ValueError(f"NANOVLLM_CPU_INT8_TILES must be 0, 1 or auto, got {forced!r}.")
    lib = cpu_ops.load()
    if lib is None:
        return False
    return bool(lib.linear_i8_tiles_vnni()) if forced == "auto" else forced == "1"


def pack_wanted() -> bool:
    """oneDNN prepacking, opt-in with NANOVLLM_CPU_PACK=1 (and a torch with oneDNN).

    Off by default: a packed matmul keeps state for every new row count it meets (measured: resident memory
    grew by ~300 MB over 600 row counts for one weight shape, then levelled off), so a server's memory would
    climb for a long while, and it gained only 4-16 % on a 2-core AVX2 machine (docs/benchmarks.md, "CPU")."""
    return os.environ.get("NANOVLLM_CPU_PACK", "0") == "1" and torch.backends.mkldnn.is_available()


def block_passes() -> int | None:
    """How many int8 passes the block kernels quantize activations in: NANOVLLM_CPU_BLOCK_PASSES=1 (int8 blocks of
    32 everywhere, as llama.cpp: fastest for many rows, but SmolLM2's near-tied first token of "What is the capital
    of France?" then goes the other way) or 2 (everywhere: the rounding's remainder as a second pass, ~15 bits);
    unset (None, the default): by each layer's role (platforms/cpu/linear.BLOCK_PASSES_BY_ROLE)."""
    value = os.environ.get("NANOVLLM_CPU_BLOCK_PASSES")
    if value is None:
        return None
    if value not in ("1", "2"):
        raise ValueError(f"NANOVLLM_CPU_BLOCK_PASSES must be 1 or 2 (or unset: by role), got {value!r}.")
    return int(value)


@dataclass(frozen=True)
class CpuSettings:
    """What the CPU can and is told to do, read once when an engine is configured."""

    forced_dtype: torch.dtype | None  # NANOVLLM_CPU_DTYPE
    blocks: bool  # the block kernels run with SIMD here (blocks_available)
    int8_tiles: bool  # NANOVLLM_CPU_INT8_TILES, resolved
    pack: bool  # NANOVLLM_CPU_PACK
    block_passes: int | None = None  # NANOVLLM_CPU_BLOCK_PASSES (None: by role)

    @classmethod
    def detect(cls) -> CpuSettings:
        return cls(forced_dtype=forced_cpu_dtype(), blocks=blocks_available(), int8_tiles=int8_tiles_wanted(),
                   pack=pack_wanted(), block_passes=block_passes())


NO_CPU = CpuSettings(forced_dtype=None, blocks=False, int8_tiles=False, pack=False)  # an engine on CUDA
