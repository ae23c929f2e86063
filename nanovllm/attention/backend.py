"""What every attention backend implements: the seam between the attention layers and a device's kernels.

The runner makes one backend at load time (``make_attention_backend``) and binds it to every attention layer
with that layer's slice of the KV pool. Then, per step::

    backend.prepare(meta, block_size)        once, before the model's forward: what every layer of the step
                                             shares (a backend that derives nothing keeps the no-op)
    with forward_context(meta):              each attention layer, in order:
        backend.fuses_qkv(...)  -> True:     backend.forward_qkv(qkv, ...)  q/k norm, RoPE, K/V store and
                                             attention from the fused qkv projection, in the backend's kernel
                                -> False:    backend.forward(q, k, v, ...)  K/V store, then attention

Both forwards store this step's K/V before attending, so a request reads the blocks that other requests of the
same step are filling (prefix caching relies on it). A step replayed from a CUDA graph runs no Python: a backend
used under graphs must not need ``prepare`` for its replays.

Backends: attention/triton_backend.py (Triton kernels, the CUDA default), platforms/cpu/attention.py (the CPU's
default: torch ops over gathered slots and the compiled C ops), attention/torch_backend.py (the reference
functions as a backend, any device). attention/reference.py is the oracle they are all tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from nanovllm.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """A backend; ``name`` is the value of ``EngineConfig.attention_backend`` that selects it."""

    name: str

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:  # noqa: B027 (a no-op by default)
        """Called once per step with the step's metadata, before any layer's forward; nothing to derive here."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """Store k, v at meta.slot_mapping, then attend: decodes [0, num_decodes), then the prefill chunks.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] -> like q.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (the layer's slice of the pool).
        k_scale, v_scale: an fp8 cache holds K / k_scale and V / v_scale (attention/kv_fp8.py); else 1.0.
        """

    def fuses_qkv(self, rotary, head_dim: int, k_cache: torch.Tensor, meta: AttentionMetadata | None,
                  qkv: torch.Tensor | None = None) -> bool:
        """Whether forward_qkv can run for this layer (rotary: its RotaryEmbedding) on this qkv in this step
        (meta: None outside a forward). The default: no fused path."""
        return False

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm, k_norm, num_heads: int,
                    num_kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Attention from the fused qkv projection [num_tokens, (heads + 2 kv heads) * head_dim], where
        fuses_qkv said so: q/k norms (RMSNorm modules or None) and RoPE applied, K/V stored, then attention.
        Returns [num_tokens, num_heads, head_dim]."""
        raise NotImplementedError(f"the {self.name} attention backend has no fused qkv path")
