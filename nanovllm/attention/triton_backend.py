"""The GPU attention backend: store K/V, then decode and prefill attention with the Triton kernels."""

from __future__ import annotations

import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.pieces import piece_recorder


class TritonAttentionBackend(AttentionBackend):
    """The CUDA default. No host syncs and nothing to prepare per step: safe to capture in a CUDA graph.

    The kernel modules (and so triton) are imported on first use, so the engine imports without triton.
    Host-side values read from ``meta``: ``num_decodes``, ``num_seqs`` (decodes + prefills),
    ``max_query_len`` (grid of the prefill kernel) and ``max_seq_len`` (split plan of the decode
    kernel: it must bound every request's seq_len; when capturing a decode CUDA graph, set it to the
    largest length the graph will replay with, e.g. max_model_len, since keys past it are not read).
    While a forward is captured in pieces (attention/pieces.py), attention over the cache is handed to the
    recorder and runs eagerly between the pieces; the K/V store stays inside them.
    """

    name = "triton"

    def __init__(self) -> None:
        from nanovllm.kernels.decode_attention import decode_attention
        from nanovllm.kernels.prefill_attention import prefill_attention
        from nanovllm.kernels.rope_store import norm_rope_store
        from nanovllm.kernels.store_kvcache import store_kvcache

        self._store_kvcache = store_kvcache
        self._norm_rope_store = norm_rope_store
        self._decode_attention = decode_attention
        self._prefill_attention = prefill_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        self._store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return self._attend(q, k_cache, v_cache, meta, scale, k_scale, v_scale)

    def fuses_qkv(self, rotary, head_dim: int, k_cache: torch.Tensor, meta: AttentionMetadata | None,
                  qkv: torch.Tensor | None = None) -> bool:
        """The fused kernel's conditions: float32 RoPE tables over the whole head, a power-of-two head_dim."""
        return (rotary.cos.dtype == torch.float32 and rotary.cos.shape[-1] == head_dim
                and head_dim & (head_dim - 1) == 0)

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm, k_norm, num_heads: int,
                    num_kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Attention from the fused qkv projection: q/k norm (when given), RoPE and the KV store in one kernel.

        rotary: a RotaryEmbedding (its float32 cos/sin tables); q_norm, k_norm: RMSNorm modules or None.
        """
        recorder = piece_recorder()
        q_out = None if recorder is None else recorder.q_destination(num_heads, k_cache.shape[-1])
        q = self._norm_rope_store(qkv, positions, rotary.cos, rotary.sin,
                                  None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                                  0.0 if q_norm is None else q_norm.eps, k_cache, v_cache, meta.slot_mapping,
                                  num_heads, num_kv_heads, k_scale, v_scale, q_out=q_out)
        return self._attend(q, k_cache, v_cache, meta, scale, k_scale, v_scale)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
        """Attention of q over the cache, whose K/V for this step's tokens are already stored."""
        recorder = piece_recorder()
        if recorder is not None:
            return recorder.split(q, lambda q, out, meta: self._attend_into(q, k_cache, v_cache, meta, scale,
                                                                             k_scale, v_scale, out))
        return self._attend_into(q, k_cache, v_cache, meta, scale, k_scale, v_scale, torch.empty_like(q))

    def _attend_into(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, k_scale: float, v_scale: float, out: torch.Tensor) -> torch.Tensor:
        nd = meta.num_decodes
        if nd:
            self._decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                   scale, meta.max_seq_len, out=out[:nd], k_scale=k_scale, v_scale=v_scale)
        if meta.num_prefills:
            # Decodes hold one token each, so the prefill tokens start at token nd.
            cu = meta.cu_seqlens_q[nd:] - nd if nd else meta.cu_seqlens_q
            self._prefill_attention(q[nd:], k_cache, v_cache, meta.block_tables[nd:], cu, meta.seq_lens[nd:],
                                    scale, meta.max_query_len, out=out[nd:], k_scale=k_scale, v_scale=v_scale)
        return out
