"""A dense decoder layer whose four linears multiply block weights (linear.BlockLinear), run as one compiled call
(cpu_ops.c, decoder_layer_blocks_f32) instead of seven, put in place of the general DecoderLayer once a CPU model
has its methods (``use_compiled_layers``).

At one row a layer's products take tens of microseconds each, and each call from Python (module dispatch,
ctypes' argument conversion, a new output tensor) costs several more; the compiled layer runs the same ops in the
same order on the same numbers, so its output is the general layer's bit for bit (tests/kernels). A step the
compiled layer cannot take (an fp8 KV cache, another attention backend, activations that are not float32) runs the
general forward.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from nanovllm.attention.metadata import peek_forward_context
from nanovllm.models.decoder import DecoderLayer, DecoderMLP
from nanovllm.platforms.cpu import cpu_ops
from nanovllm.platforms.cpu.attention import CpuAttentionBackend
from nanovllm.platforms.cpu.layers import CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul
from nanovllm.platforms.cpu.linear import BlockLinear

_P, _F, _I32, _I64 = ctypes.c_void_p, ctypes.c_float, ctypes.c_int32, ctypes.c_int64


class _BlockLinearArgs(ctypes.Structure):
    _fields_ = [("w", _P), ("d", _P), ("m", _P), ("bias", _P), ("bits", _I32), ("passes", _I32), ("in_", _I64),
                ("out", _I64)]


class _LayerArgs(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("norm_eps", _F),
                ("head_norm_eps", _F), ("scale", _F), ("kv_kind", _I32), ("qkv", _BlockLinearArgs),
                ("o", _BlockLinearArgs), ("gate_up", _BlockLinearArgs), ("down", _BlockLinearArgs),
                ("k_cache", _P), ("v_cache", _P), ("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64),
                ("block_size", _I64)]


class _StepArgs(ctypes.Structure):
    _fields_ = [("positions", _P), ("slot_mapping", _P), ("cos", _P), ("sin", _P), ("block_tables", _P),
                ("row_seq", _P), ("attend_lens", _P), ("table_stride", _I64), ("rows", _I64), ("num_threads", _I32)]


def _linear_args(linear: nn.Module) -> _BlockLinearArgs:
    method: BlockLinear = linear.linear_method
    weight = method.weight
    return _BlockLinearArgs(weight.tiles.data_ptr(), weight.d.data_ptr(), cpu_ops._ptr(weight.m),
                            cpu_ops._ptr(linear.bias), weight.bits, method.passes, method.in_features,
                            method.out_features)


class StepArgs:
    """The step's arguments every compiled layer shares, built by the first layer of each step (its tensors kept
    alive here while the C side holds their addresses)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._tensors: tuple = ()
        self.args = _StepArgs()
        self.address = ctypes.addressof(self.args)

    def of(self, meta, positions: torch.Tensor, rotary: CpuRotaryEmbedding, backend: CpuAttentionBackend,
           rows: int) -> int:
        if self._key is None or self._key[0] is not meta or self._key[1] is not positions or self._key[2] != rows:
            row_seq, attend_lens = backend.compiled_rows(meta)
            positions = positions.contiguous()
            block_tables = meta.block_tables
            self._tensors = (positions, row_seq, attend_lens, block_tables, meta.slot_mapping)
            a = self.args
            a.positions, a.slot_mapping = positions.data_ptr(), meta.slot_mapping.data_ptr()
            a.cos, a.sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
            a.block_tables, a.table_stride = block_tables.data_ptr(), block_tables.stride(0)
            a.row_seq, a.attend_lens = cpu_ops._ptr(row_seq), attend_lens.data_ptr()
            a.rows, a.num_threads = rows, torch.get_num_threads()
            self._key = (meta, positions, rows)
        return self.address


class CpuBlockDecoderLayer(DecoderLayer):
    """The general layer's modules, its forward in one compiled call where the step allows (``takes``)."""

    def __init__(self, source: DecoderLayer, steps: StepArgs):
        nn.Module.__init__(self)
        self.self_attn, self.mlp = source.self_attn, source.mlp
        self.input_layernorm, self.post_attention_layernorm = source.input_layernorm, source.post_attention_layernorm
        self.steps = steps
        self._args: _LayerArgs | None = None
        self._cache_ptr = 0  # the K cache the args were built for (the runner binds the caches after loading)
        self._address = 0

    def _layer_args(self) -> int:
        attn = self.self_attn
        k_cache, v_cache = attn.attn.k_cache, attn.attn.v_cache
        if self._args is None or self._cache_ptr != k_cache.data_ptr():
            q_norm, k_norm = attn.q_norm, attn.k_norm
            mlp = self.mlp
            self._args = _LayerArgs(
                self.input_layernorm.weight.data_ptr(), self.post_attention_layernorm.weight.data_ptr(),
                None if q_norm is None else q_norm.weight.data_ptr(),
                None if k_norm is None else k_norm.weight.data_ptr(), self.input_layernorm.eps,
                0.0 if q_norm is None else q_norm.eps, attn.attn.scale, cpu_ops.KV_KINDS[k_cache.dtype],
                _linear_args(attn.qkv_proj), _linear_args(attn.o_proj), _linear_args(mlp.gate_up_proj),
                _linear_args(mlp.down_proj), k_cache.data_ptr(), v_cache.data_ptr(), attn.num_heads,
                attn.num_kv_heads, attn.head_dim, k_cache.shape[1])
            self._cache_ptr, self._address = k_cache.data_ptr(), ctypes.addressof(self._args)
        return self._address

    def takes(self, hidden: torch.Tensor, residual: torch.Tensor | None, meta) -> bool:
        attn = self.self_attn.attn
        return (meta is not None and isinstance(attn.backend, CpuAttentionBackend) and hidden.dim() == 2
                and hidden.dtype == torch.float32 and hidden.is_contiguous()
                and (residual is None or residual.is_contiguous() and residual.dtype == torch.float32)
                and attn.k_cache.numel() > 0 and cpu_ops.kv_cache_usable(attn.k_cache))

    def forward(self, positions, hidden, residual):
        meta = peek_forward_context()
        if not self.takes(hidden, residual, meta):
            return super().forward(positions, hidden, residual)
        attn = self.self_attn
        step = self.steps.of(meta, positions, attn.rotary, attn.attn.backend, hidden.shape[0])
        if residual is None:  # the first layer: its input becomes the residual stream; the input is left as it was
            residual, out = torch.empty_like(hidden), torch.empty_like(hidden)
            cpu_ops.load().decoder_layer_blocks_f32(self._layer_args(), step, hidden.data_ptr(), residual.data_ptr(),
                                                    out.data_ptr(), 0)
            return out, residual
        # a later layer: its input is the layer before's output, overwritten with this one's
        cpu_ops.load().decoder_layer_blocks_f32(self._layer_args(), step, hidden.data_ptr(), residual.data_ptr(),
                                                hidden.data_ptr(), 1)
        return hidden, residual


def compiles(layer: nn.Module) -> bool:
    """Whether a decoder layer's parts are what decoder_layer_blocks_f32 computes: the general dense layer on one
    rank, the CPU's norms, activation and rotary (over whole heads), and four BlockLinear products."""
    if type(layer) is not DecoderLayer or type(layer.mlp) is not DecoderMLP or cpu_ops.load() is None:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(not isinstance(linear.linear_method, BlockLinear) or linear.linear_method.refine_top
           or linear.tp_size > 1 for linear in linears):
        return False
    return (isinstance(layer.input_layernorm, CpuRMSNorm) and isinstance(layer.post_attention_layernorm, CpuRMSNorm)
            and isinstance(mlp.act, CpuSiluAndMul) and isinstance(attn.rotary, CpuRotaryEmbedding)
            and attn.rotary.cos.shape[-1] == attn.head_dim and attn.rotary.cos.dtype == torch.float32
            and layer.input_layernorm.eps == layer.post_attention_layernorm.eps)


def use_compiled_layers(model: nn.Module) -> int:
    """Put a CpuBlockDecoderLayer in place of every decoder layer that ``compiles``; returns how many."""
    steps = StepArgs()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if compiles(child):
                setattr(parent, name, CpuBlockDecoderLayer(child, steps))
                count += 1
    return count
