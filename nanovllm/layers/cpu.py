"""CPU fast paths: which dtype pays on this CPU, linear weights prepacked for oneDNN, float16 or int8 weights.

On the CPU a model's time is its matmuls. torch's default ``F.linear`` goes through BLAS with the weight in
its checkpoint layout; oneDNN with the weight reordered once into its own blocked layout was 4-16 % faster
end to end on a 2-core AVX2 machine, but keeps state for every new row count (see ``can_pack``), so it is
opt-in (NANOVLLM_CPU_PACK=1). A packed layer keeps only the packed copy, so memory does not double.

One row is a matrix-vector product: it reads every weight once and is bound by memory bandwidth, not FLOPs.
With ``fp16`` (EngineConfig.cpu_fp16) a layer multiplies through fbgemm's float16-weight GEMM: float32
activations and sums, the weight stored (and read) as float16. Measured on a 2-core AVX2 machine, per layer of
SmolLM2-135M with weights not in cache: 2-3x faster than float32 at 1 row, 3-6x at 2-4 rows (the LM head
13.9 -> 3.0 ms at 1 row), 1.3-2.3x at 64 rows; the weight rounding is ~2e-4 of a layer's largest output.

With ``int8`` (EngineConfig.cpu_int8) every linear layer and the LM head multiply through torch's dynamic int8
linear (fbgemm on x86): the weight is quantized once per output channel, the activations per row (see
int8_linear), the products summed in int32 and rescaled to float32. Measured on a 2-core AVX2 machine: 1.7-2x
faster than float32 at 64-256 rows, 3x for the LM head at 64 rows and 7x for one row (a quarter of the bytes to
read); about 2 % error of a layer's largest output. With one activation scale per step instead (torch's own),
the few tokens with outsized activations coarsened all the others: the MLP's down projection (input SiLU(gate) *
up) had to keep float16 weights, and even so the top-1 agreement with float32's greedy tokens on SmolLM2-135M's
chat answers was 68 % (78 % with per-row scales and the down projection in int8). torch marks its quantized API
as deprecated: both paths need it to build their weights, and are opt-in (their tokens are not float32's;
float32 stays the default).

Steps of one or two rows (a lone request's decode) under ``int8`` multiply every layer, the down projection and
the LM head included, through kernels/cpu_ops.py's int8 matrix-vector kernel instead: its inputs are quantized
in blocks of 32 values with a scale each, so an outlier channel coarsens only its block (measured on
SmolLM2-135M's real activations: ~1-1.5 % relative error for the down projection, against 4-5 % with one
scale for the row), and it reads the weights at ~11-15 GB/s against torch's 8-12 at one row.

Where the compiled ops have AVX512-VNNI (cpu_ops.int8_tiles_wanted), steps of three rows or more multiply
through their tiled int8 kernel instead of fbgemm: the few-row kernel's numbers (activation scales per block of
32) at any row count, so a request's tokens no longer depend on how many share its steps. Measured on a 2-core
AVX512-VNNI machine (SmolLM2-135M): top-1 agreement with float32 on chat answers 78 % -> 94 % (mean
log-probability of float32's tokens -0.997 -> -0.822, float32's own -0.815), and 64 requests ~3 % faster.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanovllm.kernels import cpu_ops

# the batch size oneDNN picks the packed layout for (a hint: any number of rows works)
PACK_BATCH_HINT = 64


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX). Without it bf16 matmuls run
    through conversions and are several times slower than float32, so float32 is the CPU's default there."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check is not None and check() for check in checks)


def default_cpu_dtype() -> torch.dtype:
    """bfloat16 where the CPU has native bf16 matmuls, float32 elsewhere; NANOVLLM_CPU_DTYPE=float32 (or
    bfloat16) decides instead (the test suite pins float32: its oracle is transformers in float32)."""
    forced = os.environ.get("NANOVLLM_CPU_DTYPE")
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"NANOVLLM_CPU_DTYPE must be float32 or bfloat16, got {forced!r}.")
        return getattr(torch, forced)
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def can_pack() -> bool:
    """oneDNN prepacking, opt-in with NANOVLLM_CPU_PACK=1 (and a torch with oneDNN).

    Off by default: a packed matmul keeps state for every new row count it meets (measured: resident memory
    grew by ~300 MB over 600 row counts for one weight shape, then levelled off), so a server's memory would
    climb for a long while, and it gained only 4-16 % on a 2-core AVX2 machine (docs/benchmarks.md, "CPU")."""
    return os.environ.get("NANOVLLM_CPU_PACK", "0") == "1" and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out_features, in_features] (float32 or bfloat16) -> an opaque oneDNN tensor for packed_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T (+ b) with a weight from pack_weight; x: [..., in_features] -> [..., out_features]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out, in] float32 -> an opaque fbgemm/oneDNN packed int8 weight for int8_linear (symmetric, one
    scale per output channel)."""
    weight = weight.detach().float().contiguous()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # the quantized-tensor API's deprecation notice: see the module docstring
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(quantized, None)


class RowScaled(NamedTuple):
    """Rows given as ``values * scale`` (scale [rows, 1]), under ``cpu_int8``: what an int8 linear reads (values
    normalized to a largest magnitude of 1 by the norm or activation that wrote them) and what it returns when the
    op after it applies the scale itself (see int8_linear). Each saves a pass over the tensor."""

    values: torch.Tensor
    scale: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return self.values * self.scale


def fbgemm_takes(rows: int) -> bool:
    """Whether an int8 step of this many rows multiplies through a kernel for many rows (fbgemm's int8_linear or
    the compiled tiles, both of which read RowScaled); fewer rows take the compiled matrix-vector kernel, which
    reads plain rows."""
    return rows > cpu_ops.LINEAR_I8_MAX_ROWS


def normalize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / m, m), m each row's largest magnitude ([..., 1]; 1 for a row of zeros)."""
    if x.dim() == 2 and x.is_contiguous() and cpu_ops.usable(x):
        return cpu_ops.normalize_rows(x)  # one pass instead of four torch ops
    row_max = x.abs().amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max > 0, row_max, torch.ones_like(row_max))
    return x / row_max, row_max


def int8_linear(x: torch.Tensor | RowScaled, packed: torch.Tensor, bias: torch.Tensor | None,
                keep_row_scale: bool = False) -> torch.Tensor | RowScaled:
    """y = x W^T (+ b) with a weight from int8_weight; x float32 [..., in] is quantized per call (reduce_range:
    7-bit activations, so AVX2's 16-bit pairwise sums of int8 products cannot saturate) with a scale per row:
    fbgemm takes one scale for the whole tensor, so each row is divided by its largest magnitude first (unless x
    comes normalized, a RowScaled) and the product's row multiplied back (unless keep_row_scale, and no bias:
    then y comes as RowScaled). One scale for all rows let the few tokens with outsized activations (a prompt's
    first, say) coarsen every other row (see the module docstring)."""
    normalized, row_max = x if isinstance(x, RowScaled) else normalize_rows(x)
    # the overload itself: the op's packet checks every call's arguments in Python first (~5 us, 121 calls a step)
    y = torch.ops.quantized.linear_dynamic.default(normalized, packed, True)
    if keep_row_scale and bias is None:
        return RowScaled(y, row_max)
    y.mul_(row_max)
    return y if bias is None else y + bias


def fp16_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out, in] float32 -> an opaque fbgemm packed float16 weight for fp16_linear."""
    with warnings.catch_warnings():  # the quantized API's deprecation notice: see the module docstring
        warnings.simplefilter("ignore")
        return torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)


def fp16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T (+ b) with a weight from fp16_weight: float32 x and sums, float16 weights read."""
    y = torch.ops.quantized.linear_dynamic_fp16(x, packed)
    return y if bias is None else y + bias


def check_fbgemm(what: str) -> None:
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"{what} needs torch's fbgemm kernels (an x86 CPU with AVX2); this torch supports "
                         f"{torch.backends.quantized.supported_engines}.")


class CpuPackedMatmul:
    """Mixin of a module with a [out, in] ``weight``: after ``pack_for_cpu``, ``cpu_matmul`` multiplies by the
    oneDNN-packed copy, an int8 copy or a float16 copy (fbgemm), whichever it was given."""

    packed_weight: torch.Tensor | None = None
    int8_packed: torch.Tensor | None = None
    # (int8 weight, scales) for steps of 1-2 rows (kernels/cpu_ops.py: activation scales per block of 32, and
    # 1.2-2x faster than torch's int8 linear at one row); None without the compiled ops
    int8_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    fp16_packed: torch.Tensor | None = None
    # int8 weights laid out for the compiled tiled kernel, which takes steps of many rows with linear_i8's numbers
    # (activation scales per block of 32): used instead of fbgemm's copy where cpu_ops.int8_tiles_wanted()
    int8_tiles: cpu_ops.Int8Tiles | None = None
    # int8: return the product as RowScaled, its row scale left to the op that reads it (set by the model, which
    # knows which ops follow which layer: see DecoderForCausalLM.use_row_scales)
    keeps_row_scale = False

    def pack_for_cpu(self, release: bool = True, pack: bool = True, int8: bool = False, fp16: bool = False,
                     int8_rows: bool = False) -> None:
        """pack: multiply by a oneDNN-packed copy from now on. release: then empty the plain parameter (loading is
        over), so the model holds one copy of its weights; not when a tied embedding still reads it.
        int8: multiply in int8 instead; fp16: by fbgemm-packed float16 weights instead. int8_rows: steps of a
        few rows multiply int8 weights in the compiled kernel (when it builds), whatever the rest use."""
        tiles = int8 and cpu_ops.int8_tiles_wanted()
        # quantized once for both compiled layouts (a float temporary as large as the weight: peak memory)
        quantized = cpu_ops.quantize_weight_int8(self.weight) if (
            tiles or int8_rows) and cpu_ops.load() is not None else None
        if tiles and quantized is not None:
            self.int8_tiles = cpu_ops.int8_tiles(*quantized)
        if self.int8_tiles is not None:
            int8 = False  # the tiles take the steps of many rows (a row or two: int8_rows, faster there)
        if int8_rows:
            self.int8_rows = quantized
        if int8:
            self.int8_packed = int8_weight(self.weight)
        elif fp16:
            self.fp16_packed = fp16_weight(self.weight)
        pack = pack and not (int8 or fp16 or self.int8_tiles is not None)
        if pack:
            self.packed_weight = pack_weight(self.weight)
        if release and (pack or int8 or fp16 or self.int8_tiles is not None):
            self.weight.data = self.weight.data.new_empty(0)

    def cpu_matmul(self, x: torch.Tensor | RowScaled, bias: torch.Tensor | None) -> torch.Tensor | RowScaled:
        """y = x W^T (+ b) through whichever copy of the weight fits x (RowScaled only under int8)."""
        values = x.values if isinstance(x, RowScaled) else x
        few_rows = (self.int8_rows is not None and values.dim() == 2 and not fbgemm_takes(values.shape[0])
                    and values.is_contiguous())
        if isinstance(x, RowScaled) and (few_rows or (self.int8_packed is None and self.int8_tiles is None)):
            x = x.materialize()
        if few_rows:
            return cpu_ops.linear_i8(x, self.int8_rows, bias)
        if self.int8_tiles is not None:
            if isinstance(x, RowScaled):
                return cpu_ops.linear_i8_tiles(x.values, self.int8_tiles, bias, x.scale)
            return cpu_ops.linear_i8_tiles(x.reshape(-1, x.shape[-1]), self.int8_tiles, bias).view(
                *x.shape[:-1], -1)
        if self.int8_packed is not None:
            return int8_linear(x, self.int8_packed, bias, self.keeps_row_scale)
        if self.fp16_packed is not None:
            return fp16_linear(x, self.fp16_packed, bias)
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)


def pack_model_for_cpu(model: torch.nn.Module, int8: bool = False, fp16: bool = False) -> int:
    """Prepare every linear layer and the LM head of a loaded model for the CPU; returns how many.

    Packs only with NANOVLLM_CPU_PACK=1 (``can_pack``). int8: int8 matmuls instead. fp16: float16 weights
    (fbgemm) everywhere. Both: float32 models only.
    """
    pack = can_pack()
    if not pack and not int8 and not fp16:
        return 0
    if int8 or fp16:
        check_fbgemm("cpu_int8" if int8 else "cpu_fp16")
    users: dict[int, int] = {}  # weight -> how many modules hold it (a tied LM head shares the embedding's)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            users[id(weight)] = users.get(id(weight), 0) + 1
    count = 0
    for module in model.modules():
        pack_module = getattr(module, "pack_for_cpu", None)
        if pack_module is not None and module.weight.device.type == "cpu" and module.weight.dtype in (
                torch.float32, torch.bfloat16):
            is_float32 = module.weight.dtype == torch.float32
            layer_int8 = int8 and is_float32
            # steps of 1-2 rows: int8 through the compiled kernel, whose per-block input scales also keep a row's
            # outlier channels from coarsening the rest of it
            pack_module(release=users[id(module.weight)] == 1, pack=pack, int8=layer_int8,
                        fp16=is_float32 and fp16 and not layer_int8, int8_rows=layer_int8)
            count += 1
    if int8 and hasattr(model, "use_row_scales"):
        model.use_row_scales()  # the model knows which op reads which layer's output
    return count
