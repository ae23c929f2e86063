"""Rotary position embedding (rotate-half form) with the scaling variants a config may ask for."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.compile import cuda_compiled


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
        # CPU: (positions, cos, sin with its first half negated) of the step
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]."""
        if q.is_cuda:
            return apply_rotary(positions, q, k, self.cos, self.sin)
        return self.rotate_cpu(positions, q), self.rotate_cpu(positions, k)

    def rotate_cpu(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x rotated, as a new contiguous tensor; x: [num_tokens, heads, head_dim], any strides (e.g. the q and k
        heads of a fused qkv projection, rotated in one go).

        Three ops instead of _rotate's six (each small op costs microseconds on the CPU, and a decode step runs
        this once or twice per layer): x * cos, then each half adds the other half times a sin whose first half
        is negated (rotate_half(x) * sin without building rotate_half(x))."""
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


@cuda_compiled
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
