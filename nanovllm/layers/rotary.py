"""Rotary position embedding (rotate-half form) with the scaling variants a config may ask for."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.compile import cuda_compiled, eager_unless_compiling


def rope_parameters(config) -> dict:
    """The config's RoPE settings as one dict, across transformers versions (rope_parameters vs rope_scaling)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2], attention scaling) for the config's RoPE type."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' is not supported (its frequencies depend on the sequence length).")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_position: int):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        positions = torch.arange(max_position, dtype=torch.float32)
        # transformers' scaled variants (llama3, yarn) build their frequencies on the CPU, whatever device the
        # model is being built on
        freqs = torch.outer(positions, inv_freq.to(positions.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        # [max_position, head_dim] each; float32, cast to the activations' dtype on use
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self._apply_rotary = eager_unless_compiling(apply_rotary)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]."""
        return self._apply_rotary(positions, q, k, self.cos, self.sin)

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor, num_q_heads: int):
        """(q, k) rotated, from their heads side by side ([num_tokens, q heads + k heads, head_dim], e.g. a view of
        a fused qkv projection)."""
        return self(positions, qk[:, :num_q_heads], qk[:, num_q_heads:])


@cuda_compiled
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
