"""GGUF checkpoints: the model config, the tokenizer, and dequantized weights under Hugging Face names.

A GGUF file (llama.cpp's format) holds metadata key/values and a table of tensors, some quantized in
blocks. We read the header ourselves (`_read_header`: a few dozen lines, and ~100x faster than
`gguf.GGUFReader`, which spends seconds building a numpy view per vocabulary string), dequantize with
`gguf.quants.dequantize`, and let transformers build the tokenizer. Tensors stream one at a time
from a memory map, so loading never holds two full copies of the model.

GGUF names tensors `blk.{i}.attn_q.weight` etc. and stores shapes innermost-first; we yield
`model.layers.{i}.self_attn.q_proj.weight` in torch's `[out_features, in_features]` order. For the
llama architecture llama.cpp's converter also reorders the rows of Q and K within each head (from
Hugging Face's rotate-half rotary layout to the interleaved-pairs one); `undo_llama_qk_permute`
reverses that. qwen2 and qwen3 files are written without the reordering.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

GGUF_MAGIC = b"GGUF"

# GGUF architecture -> (Hugging Face model_type, Hugging Face model class)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# Architectures whose Q/K rows llama.cpp's converter permutes (its `LlamaModel.permute`).
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.x rope frequency factors: not a parameter; load_gguf_config turns them into `rope_scaling`.
_ROPE_FREQS = "rope_freqs.weight"

# Metadata value types of the GGUF spec: the fixed-size ones by struct format, then string and array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file."""

    name: str  # GGUF name, e.g. blk.0.attn_q.weight
    shape: tuple[int, ...]  # torch order: outermost first (GGUF stores the reverse)
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata and tensor table; no tensor data."""

    path: str
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    file_size: int

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def tensor(self, name: str) -> GGUFTensorInfo | None:
        return next((info for info in self.tensors if info.name == name), None)


def is_gguf(path: str) -> bool:
    """Whether `path` names a GGUF file: it ends in .gguf, or it is a file starting with the GGUF magic."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return False
    if path.lower().endswith(".gguf"):
        return True
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def load_gguf_config(path: str) -> PretrainedConfig:
    """A transformers config (LlamaConfig, Qwen2Config, ...) built from the file's metadata.

    `architectures` is set, `tie_word_embeddings` is true when the file has no `output.weight`, and
    `eos_token_id` is an int, or a list when the file also names end-of-turn / end-of-message tokens.
    """
    from transformers import AutoConfig

    header = _read_header(path)
    arch = _check_architecture(header)
    model_type, model_class = SUPPORTED_ARCHITECTURES[arch]
    meta = header.metadata

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden_size = _require(header, f"{arch}.embedding_length")
    num_heads = _require(header, f"{arch}.attention.head_count")
    num_kv_heads = get("attention.head_count_kv", num_heads)
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden_size // num_heads
    vocab_size = get("vocab_size")
    if vocab_size is None:  # older files: the vocabulary's length is the embedding's
        embedding = header.tensor("token_embd.weight")
        if embedding is not None:
            vocab_size = embedding.shape[0]
        elif "tokenizer.ggml.tokens" in meta:
            vocab_size = len(meta["tokenizer.ggml.tokens"])
        else:
            raise ValueError(
                f"{header.path}: cannot tell the vocabulary size (no {arch}.vocab_size, no token_embd)"
            )
    tensor_names = {info.name for info in header.tensors}
    kwargs: dict[str, Any] = dict(
        architectures=[model_class],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=_require(header, f"{arch}.feed_forward_length"),
        num_hidden_layers=_require(header, f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=get("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=_eos_token_ids(meta),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    if arch == "qwen3":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    rope_scaling = _rope_scaling(header, arch, head_dim, kwargs["rope_theta"])
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    return AutoConfig.for_model(model_type, **kwargs)


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A fast tokenizer built by transformers from the file's vocabulary, with the file's chat template."""
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(os.fspath(path))
    _check_file(path)
    folder, name = os.path.split(path)
    # The concrete class, not AutoTokenizer: AutoTokenizer first builds a config, which transformers
    # does with gguf.GGUFReader for llama files and which takes seconds.
    return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name, local_files_only=True)


def iter_gguf_tensors(path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hugging_face_name, tensor)` for each weight of the file, one at a time, in file order.

    Tensors are dequantized to `dtype`, in `[out_features, in_features]` order, Q/K rows restored to
    Hugging Face's layout for llama. `lm_head.weight` comes only when the file has `output.weight`.
    A missing file or an unsupported architecture raises here, before the first tensor.
    """
    header = _read_header(path)
    arch = _check_architecture(header)
    num_heads = _require(header, f"{arch}.attention.head_count")
    num_kv_heads = header.metadata.get(f"{arch}.attention.head_count_kv", num_heads)
    qk_heads = (num_heads, num_kv_heads) if arch in _PERMUTED_QK_ARCHITECTURES else None
    return _stream_tensors(header, dtype, qk_heads)


def _stream_tensors(
    header: GGUFHeader, dtype: torch.dtype, qk_heads: tuple[int, int] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The generator behind iter_gguf_tensors; `qk_heads` = (heads, kv heads) when Q/K rows are permuted."""
    with open(header.path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    for info in header.tensors:
        name = _hugging_face_name(header, info.name)
        if name is None:
            continue
        tensor = _read_tensor(header, buffer, info)
        if qk_heads is not None and ".self_attn.q_proj." in name:
            tensor = undo_llama_qk_permute(tensor, qk_heads[0])
        elif qk_heads is not None and ".self_attn.k_proj." in name:
            tensor = undo_llama_qk_permute(tensor, qk_heads[1])
        yield name, tensor.to(dtype)


def undo_llama_qk_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reverse llama.cpp's row permutation of a Q or K projection (weight or bias).

    Within each head Hugging Face orders the rows [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] (rotate-half
    rotary pairs (x_j, y_j)); llama.cpp stores them interleaved [x_0, y_0, x_1, y_1, ...].
    """
    # weight: [num_heads * head_dim, *rest]
    rows = weight.shape[0]
    if rows % (2 * num_heads) != 0:
        raise ValueError(
            f"a Q/K projection of {rows} rows does not split into {num_heads} heads of even size"
        )
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------------------------------------------
# Header


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")


def _read_header(path: str) -> GGUFHeader:
    path = os.fspath(path)
    _check_file(path)
    size = os.path.getsize(path)
    if size < 24:
        raise ValueError(f"{path} is not a GGUF file: {size} bytes is shorter than the GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        try:
            return _parse_header(path, buffer, size)
        except (struct.error, IndexError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is a truncated or corrupt GGUF file ({error})") from error


def _parse_header(path: str, buffer: mmap.mmap, size: int) -> GGUFHeader:
    if buffer[:4] != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {buffer[:4]!r}, not {GGUF_MAGIC!r}")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
    if version not in (2, 3):
        raise ValueError(
            f"{path} is GGUF version {version} (or big-endian); only little-endian versions 2 and 3 are supported"
        )
    pos = 24

    def read_string(pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", buffer, pos)
        end = pos + 8 + length
        return buffer[pos + 8 : end].decode("utf-8", errors="replace"), end

    def read_value(value_type: int, pos: int) -> tuple[Any, int]:
        if value_type in _SCALAR_FORMATS:
            fmt = "<" + _SCALAR_FORMATS[value_type]
            return struct.unpack_from(fmt, buffer, pos)[0], pos + struct.calcsize(fmt)
        if value_type == _STRING:
            return read_string(pos)
        if value_type != _ARRAY:
            raise ValueError(f"{path}: unknown GGUF metadata value type {value_type}")
        item_type, count = struct.unpack_from("<IQ", buffer, pos)
        pos += 12
        if item_type in _SCALAR_FORMATS:
            dtype = np.dtype("<" + _SCALAR_FORMATS[item_type])
            values = np.frombuffer(buffer, dtype=dtype, count=count, offset=pos).tolist()
            return values, pos + count * dtype.itemsize
        items = []
        for _ in range(count):  # strings (the vocabulary, the merges) or nested arrays
            item, pos = read_value(item_type, pos)
            items.append(item)
        return items, pos

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = read_string(pos)
        (value_type,) = struct.unpack_from("<I", buffer, pos)
        metadata[key], pos = read_value(value_type, pos + 4)

    entries = []
    for _ in range(tensor_count):
        name, pos = read_string(pos)
        (n_dims,) = struct.unpack_from("<I", buffer, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buffer, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buffer, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(reversed(dims)), ggml_type, offset))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = tuple(
        GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
        for name, shape, ggml_type, offset in entries
    )
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors, file_size=size)


def _check_architecture(header: GGUFHeader) -> str:
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{header.path}: GGUF architecture {arch!r} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _require(header: GGUFHeader, key: str) -> Any:
    if key not in header.metadata:
        raise ValueError(f"{header.path}: GGUF metadata lacks {key!r}")
    return header.metadata[key]


# ---------------------------------------------------------------------------------------------------
# Config


def _eos_token_ids(meta: dict[str, Any]) -> int | list[int] | None:
    # Chat models often end a turn with a token other than eos (Llama 3's <|eot_id|>); llama.cpp stops
    # on all of them, and so should we.
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = list(dict.fromkeys(meta[key] for key in keys if key in meta))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _rope_scaling(header: GGUFHeader, arch: str, head_dim: int, rope_theta: float) -> dict[str, Any] | None:
    meta = header.metadata
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", ""):
        scaling: dict[str, Any] = {
            "rope_type": scaling_type,
            "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        }
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        return scaling
    freqs = header.tensor(_ROPE_FREQS)
    if freqs is None:
        return None
    return _llama3_rope_scaling(header, freqs, head_dim, rope_theta)


def _llama3_rope_scaling(
    header: GGUFHeader, info: GGUFTensorInfo, head_dim: int, rope_theta: float
) -> dict[str, Any]:
    # llama.cpp stores Llama 3.x "llama3" rope scaling as per-frequency divisors, not as parameters.
    # All Llama 3.x releases use the constants below and vary only `factor` (the largest divisor);
    # we recompute the divisors from them and accept only an exact-enough match.
    if info.ggml_type != 0:  # F32
        raise ValueError(f"{header.path}: {_ROPE_FREQS} is ggml type {info.ggml_type}, expected F32")
    with open(header.path, "rb") as f:
        f.seek(info.offset)
        stored = np.frombuffer(f.read(4 * math.prod(info.shape)), dtype="<f4").astype(np.float64)
    scaling = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = _llama3_frequency_divisors(head_dim, rope_theta, scaling)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-4):
        raise ValueError(
            f"{header.path}: {_ROPE_FREQS} does not match Llama 3 rope scaling with factor {scaling['factor']}; "
            "this rope scaling is not supported"
        )
    return scaling


def _llama3_frequency_divisors(head_dim: int, rope_theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """What each rotary frequency is divided by under "llama3" rope scaling (as llama.cpp stores it)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * math.pi / inv_freq
    smooth = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


# ---------------------------------------------------------------------------------------------------
# Tensors


def _hugging_face_name(header: GGUFHeader, gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor; None for tensors that are not parameters."""
    if gguf_name == _ROPE_FREQS:
        return None
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is not None:
        layer, part, kind = match.groups()
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_TENSORS and kind in ("weight", "bias"):
            return f"{_GLOBAL_TENSORS[base]}.{kind}"
    raise ValueError(
        f"{header.path}: tensor {gguf_name!r} has no known Hugging Face name for GGUF architecture "
        f"{header.architecture!r}"
    )


_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # ggml F32, F16, BF16


def _read_tensor(header: GGUFHeader, buffer: mmap.mmap, info: GGUFTensorInfo) -> torch.Tensor:
    """One tensor, copied out of the file and dequantized; float32 unless stored as F16/BF16."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as error:
        raise ValueError(
            f"{header.path}: tensor {info.name!r} has unknown ggml type {info.ggml_type}"
        ) from error
    row_length = info.shape[-1]
    if row_length % block_size != 0:
        raise ValueError(
            f"{header.path}: tensor {info.name!r} has rows of {row_length} values, "
            f"not a multiple of the {qtype.name} block size {block_size}"
        )
    row_bytes = row_length // block_size * type_size
    nbytes = math.prod(info.shape[:-1]) * row_bytes
    if info.offset + nbytes > header.file_size:
        raise ValueError(f"{header.path} is truncated: tensor {info.name!r} ends past the end of the file")
    raw = np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=info.offset)

    if info.ggml_type in _FLOAT_TYPES:  # no dequantization: reinterpret a copy of the bytes
        return torch.from_numpy(raw.copy()).view(_FLOAT_TYPES[info.ggml_type]).reshape(info.shape)
    try:
        values = dequantize(raw.reshape(*info.shape[:-1], row_bytes), qtype)
    except NotImplementedError as error:
        raise ValueError(
            f"{header.path}: tensor {info.name!r} is {qtype.name}, which the gguf package cannot dequantize"
        ) from error
    return torch.from_numpy(values).reshape(info.shape)
