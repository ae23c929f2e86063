"""The CPU's own versions of the norm, activation and rotary layers, put in place of layers/' device-agnostic ones
once a CPU model has loaded (``use_cpu_layers``), as its linear layers get their methods (linear.py); and a token
embedding read from its tied LM head's weight blocks (``use_block_embedding``).

Each small torch op costs microseconds on the CPU and a decode step runs ~60 norms, 30 activations and 30
rotations, so these call the compiled ops (platforms/cpu/cpu_ops.py) where they can, and otherwise torch ops in fewer
dispatches than the general forward; they read and write rows as row_scale.RowScaled where cpu_int8's row-scale
plan asks them to (row_scale.plan_row_scales).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.embedding import VocabParallelEmbedding
from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding
from nanovllm.platforms.cpu import cpu_ops
from nanovllm.platforms.cpu.row_scale import RowScaled, fbgemm_takes


class CpuRMSNorm(RMSNorm):
    """RMSNorm (sharing the source's weight) with the residual add in the same compiled call."""

    def __init__(self, source: RMSNorm):
        super().__init__(source.weight.shape[0], source.eps)
        self.weight = source.weight
        # the output feeds cpu_int8's fbgemm steps: written normalized, as RowScaled (row_scale.plan_row_scales)
        self.emits_row_scaled = False

    def forward(self, x: torch.Tensor | RowScaled, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual). x may be an int8 linear's RowScaled
        product; norm(...) is RowScaled when emits_row_scaled (on the compiled path)."""
        x_scale = None
        if isinstance(x, RowScaled):
            x, x_scale = x
        if x.dim() == 2 and x.is_contiguous() and cpu_ops.usable(x) and (residual is not None or x_scale is None):
            # the add and the norm in one call (F.rms_norm alone takes ~30 us a row), and the row scales on the way
            # in and out
            normalize_out = self.emits_row_scaled and fbgemm_takes(x.shape[0])
            out = cpu_ops.add_rms_norm(x, self.weight, self.eps, None if residual is None else residual.contiguous(),
                                       x_scale, normalize_out)
            if not normalize_out:
                return out
            return RowScaled(*out) if residual is None else (RowScaled(*out[0]), out[1])
        if x_scale is not None:
            x = x * x_scale
        if x.dtype == torch.float32:
            # torch's one rms_norm call computes the general forward's float32 result in one dispatch instead of
            # seven
            if residual is not None:
                x = x + residual
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return out if residual is None else (out, x)
        return super().forward(x, residual)


class CpuSiluAndMul(SiluAndMul):
    """silu(gate) * up in one compiled call instead of three torch ops."""

    def __init__(self, source: SiluAndMul):
        super().__init__()
        self.emits_row_scaled = False  # as CpuRMSNorm's

    def forward(self, x: torch.Tensor | RowScaled) -> torch.Tensor | RowScaled:
        """x may be an int8 linear's RowScaled product."""
        in_scale = None
        if isinstance(x, RowScaled):
            x, in_scale = x
        if x.dim() == 2 and x.is_contiguous() and cpu_ops.usable(x):
            normalize_out = self.emits_row_scaled and fbgemm_takes(x.shape[0])
            out = cpu_ops.silu_and_mul(x, in_scale, normalize_out)
            return RowScaled(*out) if normalize_out else out
        return super().forward(x if in_scale is None else x * in_scale)


class CpuRotaryEmbedding(RotaryEmbedding):
    """RoPE in three torch ops instead of six (sharing the source's cos/sin tables), with the step's tables looked up
    once for every layer; q and k side by side in a fused qkv projection rotate in one go."""

    def __init__(self, source: RotaryEmbedding):
        nn.Module.__init__(self)  # the tables are the source's: nothing to compute
        self.register_buffer("cos", source.cos, persistent=False)
        self.register_buffer("sin", source.sin, persistent=False)
        # (positions, cos, sin with its first half negated) of the step
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor, num_q_heads: int):
        qk = self.rotate(positions, qk)
        return qk[:, :num_q_heads], qk[:, num_q_heads:]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x rotated, as a new contiguous tensor; x: [num_tokens, heads, head_dim], any strides.

        x * cos, then each half adds the other half times a sin whose first half is negated (rotate_half(x) * sin
        without building rotate_half(x))."""
        half = x.shape[-1] // 2
        # every layer of a step rotates at the same positions (one tensor): look cos/sin up once per step
        if self._step is None or self._step[0] is not positions or self._step[1].dtype != x.dtype:
            signed_sin = self.sin[positions].unsqueeze(1).to(x.dtype)  # a copy (indexed): safe to negate
            signed_sin[..., :half].neg_()
            self._step = (positions, self.cos[positions].unsqueeze(1).to(x.dtype), signed_sin)
        _, cos, signed_sin = self._step
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], signed_sin[..., :half])
        out[..., half:].addcmul_(x[..., :half], signed_sin[..., half:])
        return out


class CpuBlockEmbedding(VocabParallelEmbedding):
    """A token embedding read from the 4/8-bit blocks of its tied LM head (``use_block_embedding``), where they hold
    its float weight exactly (GGUF's Q8_0 / Q4_x): the float copy (vocabulary x hidden float32, 113 MB for
    SmolLM2-135M) is released, and each step dequantizes only its tokens' rows, to the same floats."""

    def __init__(self, source: VocabParallelEmbedding, blocks: cpu_ops.BlockWeight):
        nn.Module.__init__(self)
        self.tp, self.tp_rank, self.tp_size = source.tp, source.tp_rank, source.tp_size
        self.vocab_size, self.shard_size, self.num_valid = source.vocab_size, source.shard_size, source.num_valid
        self.vocab_start = source.vocab_start
        self.weight = source.weight  # emptied once every user reads the blocks
        self.blocks = blocks

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_ops.dequantize_rows(self.blocks, input_ids.reshape(-1))
        return rows.view(*input_ids.shape, rows.shape[-1])


# rows of the weight compared per pass when checking that blocks hold it exactly (bounds the check's memory)
EXACT_CHECK_ROWS = 4096


def use_block_embedding(model: nn.Module) -> int:
    """Put a CpuBlockEmbedding in place of each single-rank token embedding whose weight is shared with an LM head
    that multiplies by 4/8-bit blocks holding that weight exactly, and release the float weight; returns how many
    were replaced (0 for a float checkpoint, whose blocks are rounded, or an untied head)."""
    from nanovllm.layers.embedding import ParallelLMHead
    from nanovllm.platforms.cpu.linear import BlockLinear

    heads = {id(m.weight): m for m in model.modules()
             if isinstance(m, ParallelLMHead) and isinstance(m.linear_method, BlockLinear)}
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            head = heads.get(id(getattr(child, "weight", None)))
            if (type(child) is not VocabParallelEmbedding or head is None or child.tp_size > 1
                    or child.weight.dtype != torch.float32):
                continue
            blocks = head.linear_method.weight
            if blocks.shape != tuple(child.weight.shape) or not _blocks_hold(blocks, child.weight):
                continue
            setattr(parent, name, CpuBlockEmbedding(child, blocks))
            child.weight.data = child.weight.data.new_empty(0)  # the head's too (the same tensor): both read blocks
            count += 1
    return count


def _blocks_hold(blocks: cpu_ops.BlockWeight, weight: torch.Tensor) -> bool:
    for start in range(0, weight.shape[0], EXACT_CHECK_ROWS):
        rows = torch.arange(start, min(start + EXACT_CHECK_ROWS, weight.shape[0]))
        if not torch.equal(cpu_ops.dequantize_rows(blocks, rows), weight[start:start + rows.shape[0]]):
            return False
    return True


# the general layer -> its CPU version (exact types: a family's own subclass keeps its forward)
CPU_LAYERS: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: CpuRMSNorm, SiluAndMul: CpuSiluAndMul, RotaryEmbedding: CpuRotaryEmbedding}


def use_cpu_layers(model: nn.Module) -> int:
    """Put the CPU's version in place of every norm, activation and rotary layer of a loaded model (a layer shared
    by several parents, as the one rotary of a decoder, stays shared); returns how many were replaced."""
    replaced: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            cpu_layer = CPU_LAYERS.get(type(child))
            if cpu_layer is None:
                continue
            if id(child) not in replaced:
                replaced[id(child)] = cpu_layer(child)
            setattr(parent, name, replaced[id(child)])
    return len(replaced)
