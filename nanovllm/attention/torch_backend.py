"""The reference functions (attention/reference.py) as a backend: any device, reference speed.

``attention_backend="torch"`` selects it on CUDA (on the CPU that name selects the CPU's own backend,
platforms/cpu/attention.py); tests use it as the oracle of a whole backend's forward.
"""

from __future__ import annotations

import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.reference import decode_attention_ref, prefill_attention_ref, store_kvcache_ref


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        if k_cache.dtype == torch.int8:  # its rows carry their scales: only the CPU's compiled kernel reads them
            raise ValueError("the reference attention reads float and fp8 KV caches, not kv_cache_dtype 'int8'.")
        store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode_attention_ref(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                            meta.seq_lens[:nd], scale, k_scale, v_scale)
        if meta.num_prefills:
            cu = meta.cu_seqlens_q[nd:] - nd  # decodes hold one token each: the chunks start at token nd
            out[nd:] = prefill_attention_ref(q[nd:], k_cache, v_cache, meta.block_tables[nd:], cu,
                                             meta.seq_lens[nd:], scale, k_scale, v_scale)
        return out
