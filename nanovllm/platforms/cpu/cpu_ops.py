"""The CPU's fused ops (cpu_ops.c): built with the machine's C compiler on first use, called via ctypes.

A decode step of one request on a small CPU spends as long in ~30 small torch ops per layer (RMSNorm of one
row ~30 us, SDPA ~90 us, each add or copy 3-5 us) as in its matmuls; cpu_ops.c does the same work in three
calls a layer: residual add + RMSNorm, SiLU-and-mul, and RoPE + KV store + attention over the paged cache
(read in place; decodes and prefill chunks alike, where it also beats gathering each request's K/V for SDPA:
64 chunks of 20 tokens 2.4 -> 1.9 s, a 3,000-token prompt 33 -> 12.5 s on a 2-core AVX2 machine); and under
cpu_int8 an int8 matrix-vector product for steps of one or two rows and the per-row scaling of the int8
linears' inputs. The library is compiled once per source and machine (``-march=native``, OpenMP) into
``$NANOVLLM_CACHE_DIR`` (default ~/.cache/nanovllm) and loaded after torch, so its OpenMP loops run on the
libgomp torch already loaded: the same worker threads, no contention.

Without a C compiler, or with ``NANOVLLM_CPU_KERNELS=0``, ``load()`` returns None and the callers keep their
torch ops (same results up to float rounding; tests/kernels/test_cpu_ops.py checks each op against them).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "add_rms_norm_f32": [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _F, _I32],
    "silu_and_mul_f32": [_P, _P, _P, _P, _I64, _I64, _I32],
    "normalize_rows_f32": [_P, _P, _P, _I64, _I64, _I32],
    "argmax_rows_f32": [_P, _P, _I64, _I64, _I64, _I32],
    "rope_store_attention_f32": [_P, _I64, _P, _P, _P, _P, _P, _F, _P, _P, _I32, _P, _I64, _P, _P, _P, _P,
                                 _I64, _I64, _I64, _I64, _I64, _F, _I32],
    "linear_i8_f32": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I32],
    "linear_i8_tiles_f32": [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I32],
    "linear_blocks_f32": [_P, _P, _P, _P, _P, _I32, _I32, _P, _P, _I64, _I64, _I64, _I32],
    "linear_blocks_top_f32": [_P, _P, _P, _P, _P, _I32, _P, _P, _P, _P, _I64, _I64, _I64, _I32],
    "decoder_layer_blocks_f32": [_P, _P, _P, _P, _P, _I32],
}


def enabled() -> bool:
    return os.environ.get("NANOVLLM_CPU_KERNELS", "1") != "0"


def _cache_dir() -> Path:
    root = os.environ.get("NANOVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanovllm")
    return Path(root) / "cpu_ops"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    """What -march=native compiles for: a library built on one CPU may use instructions another lacks (a cache
    directory shared between machines, e.g. a network home), so the CPU's flags are part of the cache key."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()


def build(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile cpu_ops.c (unless this source, these flags and this CPU were compiled for before); returns the
    library. extra_flags: e.g. ("-mno-avx512vnni",) to build the plain paths of a CPU's wider ones (tests)."""
    flags = [*FLAGS, *extra_flags]
    identity = " ".join([compiler, *flags, _cpu_identity()])
    key = hashlib.sha256(SOURCE.read_bytes() + identity.encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile beside the target, then rename: processes building at once never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None (disabled, no compiler, or the build failed: logged once)."""
    if not enabled():
        return None
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler found: the CPU runs its decode steps with torch ops (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("building the CPU decode ops failed, using torch ops instead (slower): %s", detail)
        return None
    for name, argtypes in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, None
    lib.kv_f16_supported.argtypes, lib.kv_f16_supported.restype = [], ctypes.c_int
    lib.kv_f16 = bool(lib.kv_f16_supported())  # asked once: kv_cache_usable runs every layer of every step
    lib.linear_i8_tiles_vnni.argtypes, lib.linear_i8_tiles_vnni.restype = [], ctypes.c_int
    lib.linear_blocks_simd.argtypes, lib.linear_blocks_simd.restype = [], ctypes.c_int
    lib.dequantize_rows_blocks.argtypes = [_P, _P, _P, _I32, _P, _I64, _I64, _I64, _P]
    lib.dequantize_rows_blocks.restype = ctypes.c_int64
    return lib


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the ops apply: the library loads and every tensor is a float32 CPU tensor."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and load() is not None


# the KV cache dtypes rope_store_attention reads, by the code cpu_ops.c knows them by
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
# an int8 cache row (one token, one KV head) ends with its float32 scale
INT8_KV_SCALE_BYTES = 4


def kv_cache_row_width(dtype: torch.dtype, head_dim: int) -> int:
    """The KV cache's last dimension for head_dim values: int8 rows carry their scale's 4 bytes after them."""
    return head_dim + INT8_KV_SCALE_BYTES if dtype == torch.int8 else head_dim


def int8_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """Float rows [..., head_dim] as the int8 cache holds them, [..., head_dim + 4]: each row's values rounded to
    steps of its largest magnitude / 127 (1 / 127 for a row of zeros), then that step's float32 bytes (the torch
    reference of cpu_ops.c's store_kv)."""
    largest = x.float().abs().amax(-1, keepdim=True)
    step = torch.where(largest > 0, largest, 1.0) / 127
    values = (x / step).round().to(torch.int8)
    return torch.cat([values, step.contiguous().view(torch.int8)], dim=-1)


def float_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """The int8 cache's rows [..., head_dim + 4] read back as float32 [..., head_dim]."""
    step = rows[..., -INT8_KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return rows[..., :-INT8_KV_SCALE_BYTES].float() * step


def kv_cache_usable(k_cache: torch.Tensor) -> bool:
    """Whether rope_store_attention takes this KV cache: float32 or int8, or float16 where the build can."""
    if k_cache.device.type != "cpu" or k_cache.dtype not in KV_KINDS:
        return False
    lib = load()
    return lib is not None and (k_cache.dtype != torch.float16 or lib.kv_f16)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 x_scale: torch.Tensor | None = None, normalize_out: bool = False):
    """RMSNorm(x) * weight, or with a residual (RMSNorm(x + residual) * weight, x + residual).
    x, residual: [rows, dim] contiguous float32. x_scale ([rows, 1], with a residual only): x's rows are
    x * x_scale. normalize_out: the output comes as normalize_rows' pair (out / m, m) instead of out."""
    rows, dim = x.shape
    assert x_scale is None or residual is not None
    out = torch.empty_like(x)
    out_max = x.new_empty(rows, 1) if normalize_out else None
    summed = None if residual is None else torch.empty_like(x)
    load().add_rms_norm_f32(x.data_ptr(), _ptr(x_scale), _ptr(residual), _ptr(summed), weight.data_ptr(),
                            out.data_ptr(), _ptr(out_max), rows, dim, eps, torch.get_num_threads())
    normed = (out, out_max) if normalize_out else out
    return normed if residual is None else (normed, summed)


def silu_and_mul(gate_up: torch.Tensor, in_scale: torch.Tensor | None = None, normalize_out: bool = False):
    """silu(gate) * up of a packed [rows, 2 * half] contiguous float32 tensor -> [rows, half]. in_scale ([rows, 1]):
    gate_up's rows are gate_up * in_scale. normalize_out: see add_rms_norm."""
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    out_max = gate_up.new_empty(rows, 1) if normalize_out else None
    load().silu_and_mul_f32(gate_up.data_ptr(), _ptr(in_scale), out.data_ptr(), _ptr(out_max), rows, width // 2,
                            torch.get_num_threads())
    return (out, out_max) if normalize_out else out


def normalize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, dim] contiguous float32 -> (x / m, m) with m [rows, 1] each row's largest magnitude (1 for a row
    of zeros)."""
    rows, dim = x.shape
    out, scales = torch.empty_like(x), x.new_empty(rows, 1)
    load().normalize_rows_f32(x.data_ptr(), out.data_ptr(), scales.data_ptr(), rows, dim, torch.get_num_threads())
    return out, scales


def rope_store_attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, norm_eps: float,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         attend_lens: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                         scale: float, row_seq: torch.Tensor | None = None) -> torch.Tensor:
    """A step's attention from its fused qkv projection, one row per token, in one call: q/k norm (weights or
    None), RoPE and the K/V store of every row first, then each row's causal attention over its request's cache.

    qkv: [num_rows, (num_heads + 2 * num_kv_heads) * head_dim] float32, rows contiguous; positions,
    slot_mapping: [num_rows] int64; cos, sin: [max_position, head_dim] float32; k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim] float32, or float16 where kv_cache_usable says so (stored rounded, read
    back as float32), or int8 with a scale per row ([..., kv_cache_row_width(torch.int8, head_dim)]: see
    int8_kv_rows); block_tables: [num_seqs, max_blocks] int32; row_seq: [num_rows] int32, the request (row of
    block_tables) of each row, None when row r is request r (a decode step); attend_lens: [num_rows] int32, the
    tokens row r attends to (its position + 1, the new token included). Returns [num_rows, num_heads, head_dim].
    """
    num_rows = qkv.shape[0]
    block_size, head_dim = k_cache.shape[1], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    assert qkv.stride(1) == 1 and block_tables.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[3] == kv_cache_row_width(k_cache.dtype, head_dim) and v_cache.dtype == k_cache.dtype
    out = qkv.new_empty(num_rows, num_heads, head_dim)
    load().rope_store_attention_f32(
        qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), _ptr(q_norm),
        _ptr(k_norm), norm_eps, k_cache.data_ptr(), v_cache.data_ptr(), KV_KINDS[k_cache.dtype],
        block_tables.data_ptr(), block_tables.stride(0), _ptr(row_seq), attend_lens.data_ptr(),
        slot_mapping.data_ptr(), out.data_ptr(), num_rows, num_heads, num_kv_heads, head_dim, block_size, scale,
        torch.get_num_threads())
    return out


# steps of up to this many rows multiply int8 weights here; more rows go to torch's int8 GEMM (fbgemm), which
# wins once the product is bound by arithmetic rather than by reading the weights
LINEAR_I8_MAX_ROWS = 2


# linear_i8 quantizes its input in blocks of this many values (cpu_ops.c's QBLOCK)
QUANT_BLOCK = 32


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a [rows, cols] float32 tensor whose rows are contiguous -> int64 [rows]."""
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    load().argmax_rows_f32(x.data_ptr(), out.data_ptr(), rows, cols, x.stride(0), torch.get_num_threads())
    return out


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight [out, in] float -> (int8 weight [out, in], float32 scale [out]), one symmetric scale per output
    channel ([-127, 127]); None when linear_i8 cannot take this in_features (not a multiple of QUANT_BLOCK)."""
    if weight.shape[1] % QUANT_BLOCK:
        return None
    weight = weight.detach().float()
    scale = (torch.linalg.vector_norm(weight, float("inf"), dim=1) / 127).clamp_min(1e-12)
    # one float temporary, rounded in place: the LM head's is as large as its float32 weight (peak memory)
    steps = weight / scale[:, None]
    return steps.round_().clamp_(-127, 127).to(torch.int8), scale.contiguous()


def linear_i8(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) for x [rows, in] contiguous float32 (rows <= LINEAR_I8_MAX_ROWS) and a quantize_weight_int8 pair."""
    w, scale = weight
    rows = x.shape[0]
    y = x.new_empty(rows, w.shape[0])
    load().linear_i8_f32(x.data_ptr(), w.data_ptr(), scale.data_ptr(), _ptr(bias), y.data_ptr(), rows, w.shape[1],
                         w.shape[0], torch.get_num_threads())
    return y


# linear_i8_tiles' weights come in tiles of this many output channels
TILE = 16


class Int8Tiles(NamedTuple):
    """An int8 weight laid out for linear_i8_tiles (cpu_ops.c): tiles [out / 16, in / 4, 16, 4], the correction
    of each block's sums w_sum [out / 16, in / 32, 16] (128 x the block's weight sum), and the per-channel scales
    [out]. The same quantization as quantize_weight_int8."""

    tiles: torch.Tensor
    w_sum: torch.Tensor
    scale: torch.Tensor


def quantize_weight_int8_tiles(weight: torch.Tensor) -> Int8Tiles | None:
    """weight [out, in] float -> Int8Tiles; None when the shape does not tile (out not a multiple of 16, or in of
    QUANT_BLOCK)."""
    quantized = quantize_weight_int8(weight)
    return None if quantized is None else int8_tiles(*quantized)


def int8_tiles(q: torch.Tensor, scale: torch.Tensor) -> Int8Tiles | None:
    """quantize_weight_int8's pair laid out as Int8Tiles; None when out_features is not a multiple of 16."""
    out_features, in_features = q.shape
    if out_features % TILE:
        return None
    tiles = q.view(out_features // TILE, TILE, in_features // 4, 4).transpose(1, 2).contiguous()
    block_sums = q.view(out_features // TILE, TILE, in_features // QUANT_BLOCK, QUANT_BLOCK).sum(-1, dtype=torch.int32)
    return Int8Tiles(tiles, (128 * block_sums).transpose(1, 2).contiguous(), scale)


def linear_i8_tiles(x: torch.Tensor, weight: Int8Tiles, bias: torch.Tensor | None,
                    row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for x [rows, in] float32 (any number of rows) and an Int8Tiles weight; row_scale [rows] (or
    [rows, 1]): the input is x's rows times it (normalized rows, see platforms/cpu/row_scale.RowScaled)."""
    x = x.contiguous()
    rows, in_features = x.shape
    out_features = weight.scale.shape[0]
    y = x.new_empty(rows, out_features)
    if row_scale is not None:
        row_scale = row_scale.contiguous()
    load().linear_i8_tiles_f32(x.data_ptr(), _ptr(row_scale), weight.tiles.data_ptr(), weight.w_sum.data_ptr(),
                               weight.scale.data_ptr(), _ptr(bias), y.data_ptr(), rows, in_features, out_features,
                               torch.get_num_threads())
    return y


# linear_blocks' SIMD paths, by the code linear_blocks_simd returns
BLOCKS_SIMD = {2: "avx512-vnni", 1: "avx2", 0: "plain C"}


class BlockWeight(NamedTuple):
    """A weight in blocks of 32 inputs of one output channel for linear_blocks (cpu_ops.c): bits 4 (w = d * q + m,
    q in [0, 15]: GGUF's Q4_1, and Q4_0 with m = -8 d) or 8 (w = d * q, q in [-127, 127]: GGUF's Q8_0), laid out in
    tiles of 16 channels: tiles uint8 [out / 16, in / 8 (4 bits) or in / 4 (8 bits), 16, 4]; d and m float16
    [out / 16, in / 32, 16] (m None for 8 bits)."""

    bits: int
    tiles: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0] * TILE, self.d.shape[1] * QUANT_BLOCK


def blocks_of(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    return weight.detach().float().reshape(out_features, in_features // QUANT_BLOCK, QUANT_BLOCK)


def _exact_q4(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, whether d * q + m gives each block of w back exactly) for float16 d, m [..., blocks]."""
    df, mf = d.float()[..., None], m.float()[..., None]
    q = torch.where(df != 0, (w - mf) / df, 0.0).round_().clamp_(0, 15)
    return q, (df * q + mf == w).all(-1)


def _blocks_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Q4_1's reading of every block of w [..., 32], then Q4_0's of those it does not give back."""
    low, high = w.amin(-1), w.amax(-1)
    d, m = ((high - low) / 15).half(), low.half()
    q, exact = _exact_q4(w, d, m)
    if bool(exact.all()):
        return q, d, m
    rest = ~exact
    largest = torch.where(high[rest].abs() > low[rest].abs(), high[rest], low[rest])
    d0 = (-largest / 8).half()
    m0 = (-8 * d0.float()).half()
    q0, exact0 = _exact_q4(w[rest], d0, m0)
    if not bool(exact0.all()):
        return None
    q[rest], d[rest], m[rest] = q0, d0, m0
    return q, d, m


def quantize_blocks_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """weight [out, in] -> (q uint8 [out, in] in [0, 15], d, m float16 [out, in / 32]) when every block of 32 is
    exactly d * q + m (a weight dequantized from GGUF's Q4_0 or Q4_1 is: its own blocks come back), else None.
    Q4_1 blocks span q = 0 to 15 (d = (max - min) / 15, m = min); Q4_0 blocks have q = 0 at their value of
    largest magnitude (d = -that / 8, m = -8 d)."""
    w = blocks_of(weight)
    if _blocks_q4(w[:TILE]) is None:  # most weights that are not 4-bit say so in their first rows
        return None
    blocks = _blocks_q4(w)
    if blocks is None:
        return None
    q, d, m = blocks
    return q.to(torch.uint8).reshape(weight.shape), d, m


def quantize_blocks_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q int8 [out, in] in [-127, 127], d float16 [out, in / 32]): d = each block's largest
    magnitude / 127 (a weight dequantized from GGUF's Q8_0 gets its own blocks back)."""
    w = blocks_of(weight)
    d = (w.abs().amax(-1) / 127).half()
    df = d.float()[..., None]
    q = torch.where(df != 0, w / df, 0.0).round_().clamp_(-127, 127)
    return q.to(torch.int8).reshape(weight.shape), d


def block_weight(weight: torch.Tensor, bits: int | None = None) -> BlockWeight | None:
    """weight [out, in] float -> BlockWeight: 4 bits when that is exact (bits None: a GGUF Q4_0 / Q4_1 source),
    else 8 (any other source: GGUF's Q8_0 exactly, others rounded to 8 bits a block). None when the shape does not
    tile (out not a multiple of 16, in of 32) or a scale overflows float16."""
    out_features, in_features = weight.shape
    if out_features % TILE or in_features % QUANT_BLOCK:
        return None
    q4 = quantize_blocks_q4(weight) if bits in (None, 4) else None
    if q4 is None and bits == 4:
        raise ValueError("weight is not exactly 4-bit blocks (a GGUF Q4_0 or Q4_1 tensor)")
    if q4 is not None:
        q, d, m = q4
        tiles = q.view(out_features // TILE, TILE, in_features // 8, 2, 4)
        tiles = (tiles[..., 0, :] | tiles[..., 1, :] << 4).transpose(1, 2).contiguous()
        bits = 4
    else:
        q, d = quantize_blocks_q8(weight)
        m = None
        tiles = q.view(torch.uint8).view(out_features // TILE, TILE, in_features // 4, 4).transpose(1, 2).contiguous()
        bits = 8
    if not bool(torch.isfinite(d).all()) or (m is not None and not bool(torch.isfinite(m).all())):
        return None

    def by_tile(scales: torch.Tensor) -> torch.Tensor:
        return scales.view(out_features // TILE, TILE, -1).transpose(1, 2).contiguous()
    return BlockWeight(bits, tiles, by_tile(d), None if m is None else by_tile(m))


def dequantize_rows(weight: BlockWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows (output channels, int64 [n]) of the float32 weight that dequantize_blocks gives, bit for bit (the same
    float32 products): an embedding's lookup from the blocks its tied LM head multiplies by. One compiled call
    where the ops load (a decode step's lookup was ~10 torch ops, ~0.2-0.6 ms), else dequantize_rows_torch."""
    lib = load()
    if lib is None:
        return dequantize_rows_torch(weight, rows)
    rows = rows.to(torch.int64).contiguous()
    out_features, in_features = weight.shape
    out = torch.empty(rows.shape[0], in_features)
    bad = lib.dequantize_rows_blocks(weight.tiles.data_ptr(), weight.d.data_ptr(), _ptr(weight.m), weight.bits,
                                     rows.data_ptr(), rows.shape[0], in_features, out_features, out.data_ptr())
    if bad:
        outside = rows[(rows < 0) | (rows >= out_features)][:8].tolist()
        raise IndexError(f"{bad} row ids outside [0, {out_features}): {outside}")
    return out


def dequantize_rows_torch(weight: BlockWeight, rows: torch.Tensor) -> torch.Tensor:
    """dequantize_rows in torch ops (the compiled one's reference)."""
    tile, lane = rows // TILE, rows % TILE
    d = weight.d[tile, :, lane].float().unsqueeze(-1)  # [n, in / 32, 1]
    packed = weight.tiles[tile, :, lane, :]  # [n, in / 8 or in / 4, 4]
    if weight.bits == 4:
        q = torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(rows.shape[0], -1, QUANT_BLOCK).float()
        m = weight.m[tile, :, lane].float().unsqueeze(-1)
        return (d * q + m).reshape(rows.shape[0], -1)
    q = packed.view(torch.int8).reshape(rows.shape[0], -1, QUANT_BLOCK).float()
    return (d * q).reshape(rows.shape[0], -1)


def dequantize_blocks(weight: BlockWeight) -> torch.Tensor:
    """The float32 weight [out, in] a BlockWeight multiplies by (the reference of its layout)."""
    out_features, in_features = weight.shape
    d = weight.d.transpose(1, 2).reshape(out_features, -1, 1).float()
    if weight.bits == 4:
        low, high = weight.tiles & 0x0F, weight.tiles >> 4  # [tiles, in / 8, 16, 4]
        q = torch.stack([low, high], dim=3).transpose(1, 2).reshape(out_features, -1, QUANT_BLOCK).float()
        m = weight.m.transpose(1, 2).reshape(out_features, -1, 1).float()
        return (d * q + m).reshape(out_features, in_features)
    q = weight.tiles.view(torch.int8).transpose(1, 2).reshape(out_features, -1, QUANT_BLOCK).float()
    return (d * q).reshape(out_features, in_features)


def linear_blocks(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None,
                  row_scale: torch.Tensor | None = None, passes: int = 2) -> torch.Tensor:
    """x W^T (+ b) for x [..., in] float32 and a BlockWeight: x's rows quantized in blocks of 32 as linear_i8's,
    passes 2: then what that rounding left out, to int8 steps 256 times finer, its integer sums joined with the
    first pass's (activations to ~15 bits; cpu_ops.c, quantize_row_blocks);
    row_scale [rows] or [rows, 1] (2-D x only): the input is x's rows times it."""
    if passes not in (1, 2):
        raise ValueError(f"passes must be 1 or 2, got {passes}")
    return _block_product(load().linear_blocks_f32, x, weight, (passes,), bias, row_scale)


def _block_product(product, x: torch.Tensor, weight: BlockWeight, args: tuple, bias: torch.Tensor | None,
                   row_scale: torch.Tensor | None) -> torch.Tensor:
    """y [..., out] of one of cpu_ops.c's block products (x, row_scale, the weight's blocks, args, bias, y, sizes)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()
    rows, in_features = x.shape
    out_features = weight.d.shape[0] * TILE
    y = x.new_empty(rows, out_features)
    if row_scale is not None:
        row_scale = row_scale.contiguous()
    product(x.data_ptr(), _ptr(row_scale), weight.tiles.data_ptr(), weight.d.data_ptr(), _ptr(weight.m), weight.bits,
            *args, _ptr(bias), y.data_ptr(), rows, in_features, out_features, torch.get_num_threads())
    return y.view(*shape[:-1], out_features)


class BlockBound(NamedTuple):
    """A block weight's bounds for linear_blocks_top: per_channel float16 [out, in / 32], at least channel c's sum of
    |w| over each block of 32 inputs (the float32 weight dequantize_blocks gives, summed in float64, rounded up),
    and largest float32 [in / 32], at least every channel's."""

    per_channel: torch.Tensor
    largest: torch.Tensor


# channels of a weight block_bound dequantizes at a time (bounds its memory)
BOUND_ROWS = 4096


def block_bound(weight: BlockWeight) -> BlockBound:
    """The BlockBound of a block weight, BOUND_ROWS channels at a time (no float copy of the whole weight)."""
    out_features, in_features = weight.shape
    parts = []
    for start in range(0, out_features, BOUND_ROWS):
        rows = dequantize_rows(weight, torch.arange(start, min(start + BOUND_ROWS, out_features)))
        exact = rows.double().abs().view(rows.shape[0], -1, QUANT_BLOCK).sum(-1)
        rounded = exact.half()
        parts.append(torch.where(rounded.double() < exact, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)),
                                 rounded))
    per_channel = torch.cat(parts).contiguous()
    return BlockBound(per_channel, per_channel.float().amax(0).contiguous())


def linear_blocks_top(x: torch.Tensor, weight: BlockWeight, bound: BlockBound, bias: torch.Tensor | None,
                      row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """linear_blocks with one pass, except that each row's tiles of 16 outputs that may hold its two-pass maximum
    come with two passes (cpu_ops.c, linear_blocks_top_f32): each row's largest output, and every output that may
    be the two-pass product's largest, is linear_blocks(passes=2)'s bit for bit (a greedy token is the two-pass
    one's); the others are one pass's. bound: block_bound(weight). x [..., in] float32; row_scale as
    linear_blocks'."""
    return _block_product(load().linear_blocks_top_f32, x, weight,
                          (bound.per_channel.data_ptr(), bound.largest.data_ptr()), bias, row_scale)
