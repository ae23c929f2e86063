"""The CPU's linear methods (layers/linear_method.LinearMethod), one per weight format, and the choice of one for
every linear layer and the LM head of a loaded model (``prepare_model``).

On the CPU a model's time is its matmuls. One row is a matrix-vector product: it reads every weight once and is
bound by memory bandwidth, not FLOPs; many rows are bound by arithmetic.

- ``BlockLinear`` (the default with no flags where the compiled ops have AVX2 or AVX512-VNNI): weights in blocks of
  32 inputs with a float16 scale each, 4 bits (w = d q + m: GGUF's Q4_0 and Q4_1 blocks, taken as they are) or 8
  bits (w = d q: GGUF's Q8_0, and every other source rounded to it), activations quantized per block of 32 as
  llama.cpp does (platforms/cpu/cpu_ops.py, linear_blocks). A 4-bit weight reads 0.625 bytes, float32's 4.
- ``PackedLinear``: the weight reordered once into oneDNN's blocked layout, 4-16 % faster than F.linear on a
  2-core AVX2 machine but with state for every new row count (opt-in: NANOVLLM_CPU_PACK=1).
- ``Fp16Linear`` (cpu_fp16): fbgemm's float16-weight GEMM, float32 activations and sums. Measured on a 2-core AVX2
  machine, per layer of SmolLM2-135M with weights not in cache: 2-3x faster than float32 at 1 row, 3-6x at 2-4
  rows, 1.3-2.3x at 64 rows; the weight rounding is ~2e-4 of a layer's largest output.
- ``Int8Linear`` (cpu_int8): int8 weights per output channel. Steps of one or two rows go through the compiled
  matrix-vector kernel (activations per block of 32); more rows through the compiled tiles (the same numbers,
  where the build has AVX512-VNNI) or torch's dynamic int8 linear (fbgemm: per-row 7-bit activations, its rows
  handed between ops as platforms/cpu/row_scale.RowScaled). torch marks its quantized API as deprecated: both
  fbgemm paths need it to build their weights.
"""

from __future__ import annotations

import warnings

import torch

from nanovllm.layers.linear_method import UNQUANTIZED, LinearMethod
from nanovllm.platforms.cpu import cpu_ops
from nanovllm.platforms.cpu.row_scale import RowScaled, fbgemm_takes, normalize_rows

# the batch size oneDNN picks the packed layout for (a hint: any number of rows works)
PACK_BATCH_HINT = 64


def _plain(x: torch.Tensor | RowScaled) -> torch.Tensor:
    return x.materialize() if isinstance(x, RowScaled) else x


class PackedLinear(LinearMethod):
    """oneDNN-packed copy of the weight (float32 or bfloat16)."""

    owns_weight = True

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)

    def apply(self, layer, x, bias):
        return torch.ops.mkldnn._linear_pointwise(_plain(x), self.packed, bias, "none", [], "")


class Fp16Linear(LinearMethod):
    """fbgemm's float16 weights: float32 x and sums, float16 weights read."""

    owns_weight = True

    def __init__(self, weight: torch.Tensor):
        with warnings.catch_warnings():  # the quantized API's deprecation notice: see the module docstring
            warnings.simplefilter("ignore")
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)

    def apply(self, layer, x, bias):
        y = torch.ops.quantized.linear_dynamic_fp16(_plain(x), self.packed)
        return y if bias is None else y + bias


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


def int8_linear(x: torch.Tensor | RowScaled, packed: torch.Tensor, bias: torch.Tensor | None,
                keep_row_scale: bool = False) -> torch.Tensor | RowScaled:
    """y = x W^T (+ b) with a weight from int8_weight; x float32 [..., in] is quantized per call (reduce_range:
    7-bit activations, so AVX2's 16-bit pairwise sums of int8 products cannot saturate) with a scale per row:
    fbgemm takes one scale for the whole tensor, so each row is divided by its largest magnitude first (unless x
    comes normalized, a RowScaled) and the product's row multiplied back (unless keep_row_scale, and no bias:
    then y comes as RowScaled). One scale for all rows let the few tokens with outsized activations (a prompt's
    first, say) coarsen every other row: top-1 agreement with float32 on SmolLM2's chat answers fell to 68 %."""
    normalized, row_max = x if isinstance(x, RowScaled) else normalize_rows(x)
    # the overload itself: the op's packet checks every call's arguments in Python first (~5 us, 121 calls a step)
    y = torch.ops.quantized.linear_dynamic.default(normalized, packed, True)
    if keep_row_scale and bias is None:
        return RowScaled(y, row_max)
    y.mul_(row_max)
    return y if bias is None else y + bias


class Int8Linear(LinearMethod):
    """int8 weights, one scale per output channel, in up to two copies: ``rows`` (platforms/cpu/cpu_ops.linear_i8, steps
    of one or two rows; None without the compiled ops) and, for more rows, ``tiles`` (cpu_ops.linear_i8_tiles)
    or ``packed`` (fbgemm)."""

    owns_weight = True

    def __init__(self, weight: torch.Tensor, tiles: bool):
        # quantized once for both compiled layouts (a float temporary as large as the weight: peak memory)
        quantized = cpu_ops.quantize_weight_int8(weight) if cpu_ops.load() is not None else None
        self.rows = quantized
        self.tiles = cpu_ops.int8_tiles(*quantized) if tiles and quantized is not None else None
        self.packed = int8_weight(weight) if self.tiles is None else None
        # return the product as RowScaled, its row scale left to the op that reads it (set where the op after it
        # takes that: model.plan_row_scales)
        self.keeps_row_scale = False

    @property
    def takes_row_scaled(self) -> bool:
        return self.packed is not None

    def apply(self, layer, x, bias):
        values = x.values if isinstance(x, RowScaled) else x
        if self.rows is not None and values.dim() == 2 and not fbgemm_takes(values.shape[0]) and values.is_contiguous():
            return cpu_ops.linear_i8(_plain(x), self.rows, bias)
        if self.tiles is not None:
            if isinstance(x, RowScaled):
                return cpu_ops.linear_i8_tiles(x.values, self.tiles, bias, x.scale)
            return cpu_ops.linear_i8_tiles(x.reshape(-1, x.shape[-1]), self.tiles, bias).view(*x.shape[:-1], -1)
        return int8_linear(x, self.packed, bias, self.keeps_row_scale)


class BlockLinear(LinearMethod):
    """4- or 8-bit weight blocks (platforms/cpu/cpu_ops.BlockWeight) at every row count; activations in ``passes``
    int8 passes (1 or 2), and with ``refine_top`` (one pass only: an LM head) each row's outputs near its largest
    again with two passes (cpu_ops.linear_blocks_top: a greedy token is the two-pass product's)."""

    owns_weight = True

    def __init__(self, weight: cpu_ops.BlockWeight, passes: int = 2, refine_top: bool = False):
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, got {passes}")
        if refine_top and passes != 1:
            raise ValueError("refine_top takes one pass (two passes are two passes everywhere)")
        self.weight, self.passes, self.refine_top = weight, passes, refine_top
        self.bound = cpu_ops.block_bound(weight) if refine_top else None
        # a decode step calls ~120 of these: its arguments that never change, looked up once (the tensors live
        # as long as the weight)
        self.out_features, self.in_features = weight.shape
        lib = cpu_ops.load()
        blocks = (weight.tiles.data_ptr(), weight.d.data_ptr(), cpu_ops._ptr(weight.m), weight.bits)
        if refine_top:
            self._product = lib.linear_blocks_top_f32
            self._weight_args = (*blocks, self.bound.per_channel.data_ptr(), self.bound.largest.data_ptr())
        else:
            self._product, self._weight_args = lib.linear_blocks_f32, (*blocks, passes)

    def apply(self, layer, x, bias):
        if (isinstance(x, RowScaled) or x.dim() != 2 or not x.is_contiguous() or x.dtype != torch.float32
                or x.shape[1] != self.in_features):
            values, scale = (x.values, x.scale) if isinstance(x, RowScaled) else (x, None)
            if self.refine_top:
                return cpu_ops.linear_blocks_top(values, self.weight, self.bound, bias, scale)
            return cpu_ops.linear_blocks(values, self.weight, bias, scale, self.passes)
        # the compiled product's arguments in place (the two products take them in the same order)
        rows = x.shape[0]
        y = x.new_empty(rows, self.out_features)
        self._product(x.data_ptr(), None, *self._weight_args, None if bias is None else bias.data_ptr(),
                      y.data_ptr(), rows, self.in_features, self.out_features, torch.get_num_threads())
        return y


# The blocks' activation passes of a layer by its role (its module's last name; "lm_head": a model's LM head), where
# NANOVLLM_CPU_BLOCK_PASSES does not set one number for all; measured on SmolLM2 (docs/benchmarks.md): one pass
# in the MLP's gate/up projection (half of a layer's products; top-1 agreement with float32 teacher-forced 99.9 ->
# 98.1 %), the LM head one pass with each row's near-top outputs in two (ONE_PASS_TOP: its greedy tokens are two
# passes'), two elsewhere (one pass in qkv_proj or down_proj, or a plain one-pass LM head, each flips the near-tie
# of "What is the capital of France?": "The" -1.88 against "L" -1.97 in float32).
ONE_PASS_TOP = "one pass, near-top two"
BLOCK_PASSES_BY_ROLE: dict[str, int | str] = {"gate_up_proj": 1, "lm_head": ONE_PASS_TOP}


def block_passes_of(role: str, forced: int | None) -> tuple[int, bool]:
    """(passes, refine_top) of BlockLinear for a layer of this role; forced: NANOVLLM_CPU_BLOCK_PASSES (1 or 2 for
    every layer and the LM head alike) or None (BLOCK_PASSES_BY_ROLE, else 2)."""
    if forced is not None:
        return forced, False
    chosen = BLOCK_PASSES_BY_ROLE.get(role, 2)
    return (1, True) if chosen == ONE_PASS_TOP else (chosen, False)


def linear_method(weight: torch.Tensor, kind: str, int8_tiles: bool = False, block_passes: int | None = None,
                  role: str = "") -> LinearMethod:
    """The method of kind (settings.CPU_LINEAR_METHODS) for a float weight [out, in]; the default (F.linear on the
    float weight) where the kind does not take this weight (a bfloat16 weight under int8 or fp16, a shape the
    block kernels do not tile). block_passes, role: see block_passes_of."""
    if kind == "packed":
        return PackedLinear(weight)
    if weight.dtype != torch.float32:  # the others compute in float32 (the config sees to it)
        return UNQUANTIZED
    if kind == "fp16":
        return Fp16Linear(weight)
    if kind == "int8":
        return Int8Linear(weight, int8_tiles)
    if kind == "blocks":
        blocks = cpu_ops.block_weight(weight)
        return UNQUANTIZED if blocks is None else BlockLinear(blocks, *block_passes_of(role, block_passes))
    return UNQUANTIZED


def set_linear_method(layer: torch.nn.Module, method: LinearMethod, release: bool = True) -> None:
    """Give a layer its method; release: then empty the float weight the method copied (loading is over), so the
    model holds one copy of its weights; not when a tied embedding still reads it."""
    layer.linear_method = method
    if release and method.owns_weight:
        layer.weight.data = layer.weight.data.new_empty(0)


def check_fbgemm(what: str) -> None:
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"{what} needs torch's fbgemm kernels (an x86 CPU with AVX2); this torch supports "
                         f"{torch.backends.quantized.supported_engines}.")


def use_linear_methods(model: torch.nn.Module, kind: str, int8_tiles: bool = False,
                       block_passes: int | None = None) -> int:
    """Give every linear layer and the LM head of a loaded CPU model the method of kind; returns how many changed.

    kind: the config's ``cpu_linear`` (settings.CPU_LINEAR_METHODS). int8_tiles: int8's steps of many rows
    through the compiled tiles (the config's ``cpu.int8_tiles``); block_passes: the blocks' activation passes
    (``cpu.block_passes``: 1 or 2 for all, None: by role, block_passes_of)."""
    from nanovllm.layers.embedding import ParallelLMHead

    if kind == "float":
        return 0
    if kind in ("int8", "fp16"):
        check_fbgemm("cpu_int8" if kind == "int8" else "cpu_fp16")
    users: dict[int, int] = {}  # weight -> how many modules hold it (a tied LM head shares the embedding's)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            users[id(weight)] = users.get(id(weight), 0) + 1
    count = 0
    for name, module in model.named_modules():
        if (getattr(module, "linear_method", None) is not UNQUANTIZED or module.weight.device.type != "cpu"
                or module.weight.dtype not in (torch.float32, torch.bfloat16)):  # a method chosen before (fp8)
            continue
        role = "lm_head" if isinstance(module, ParallelLMHead) else name.rpartition(".")[2]
        method = linear_method(module.weight, kind, int8_tiles, block_passes, role)
        if method is not UNQUANTIZED:
            set_linear_method(module, method, release=users[id(module.weight)] == 1)
            count += 1
    return count

