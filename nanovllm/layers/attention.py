"""The attention layer: hands q, k, v and its slice of the KV pool to the step's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.kv_fp8 import is_fp8
from nanovllm.attention.metadata import get_forward_context, peek_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.backend: AttentionBackend | None = None
        # an fp8 cache holds K / k_scale and V / v_scale (attention/kv_fp8.py): the checkpoint's scales when it
        # has them (loader/weights.py fills checkpoint_kv_scales: {"k_scale": ..., "v_scale": ...}), else 1.0
        self.checkpoint_kv_scales: dict[str, float] = {}
        self.k_scale = self.v_scale = 1.0

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend) -> None:
        """Give this layer its KV cache views ([num_blocks, block_size, num_kv_heads, head_dim]) and backend."""
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend
        fp8 = is_fp8(k_cache.dtype)
        self.k_scale = self.checkpoint_kv_scales.get("k_scale", 1.0) if fp8 else 1.0
        self.v_scale = self.checkpoint_kv_scales.get("v_scale", 1.0) if fp8 else 1.0

    def fuses_qkv(self, rotary, qkv: torch.Tensor | None = None) -> bool:
        """Whether forward_qkv can run (on this qkv, this step, inside a forward): the backend has a fused kernel
        for it and the RoPE tables suit it."""
        return self.backend is not None and self.backend.fuses_qkv(rotary, self.head_dim, self.k_cache,
                                                                    peek_forward_context(), qkv)

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm, k_norm) -> torch.Tensor:
        """Attention straight from the fused qkv projection [num_tokens, (heads + 2 kv heads) * head_dim]: the
        backend applies the q/k norms (modules or None) and rotary in the same kernel that stores K/V."""
        return self.backend.forward_qkv(qkv, positions, rotary, q_norm, k_norm, self.num_heads, self.num_kv_heads,
                                        self.k_cache, self.v_cache, get_forward_context(), self.scale,
                                        self.k_scale, self.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] -> like q."""
        assert self.backend is not None, "attention layer used before the runner bound its KV cache"
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, get_forward_context(), self.scale,
                                    self.k_scale, self.v_scale)
