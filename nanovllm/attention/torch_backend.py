"""Attention over the paged KV cache in plain torch: runs anywhere, and is the oracle for the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.attention.metadata import AttentionMetadata


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V into its cache slot; slots < 0 are skipped.

    k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one request from the paged cache: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, kvh, hd]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per request, batched with padding.

    q: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs]
    returns [num_seqs, num_heads, head_dim] in q's dtype (softmax in float32)
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long().clamp(0, k_cache.shape[0] - 1)  # padding ids: never used
    keys = k_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].float()
    values = v_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].float()
    group = num_heads // num_kv_heads
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * scale  # [B, kvh, group, L]
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a padding request (seq_len 0) attends to nothing
    out = torch.einsum("bhgl,blhd->bhgd", probs, values)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Causal attention of each request's query chunk over its cached context plus itself.

    q: [num_tokens, num_heads, head_dim] (requests packed by cu_seqlens_q); the chunk's own K/V must already
    be in the cache. Query i of a request sits at absolute position context_len + i and sees keys 0..that.
    """
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        context_len = seq_len - query_len
        keys = gather_kv(k_cache, block_tables[i], seq_len).float()
        values = gather_kv(v_cache, block_tables[i], seq_len).float()
        if num_heads != num_kv_heads:
            keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
            values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q_pos = torch.arange(context_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [query_len, seq_len]
        o = F.scaled_dot_product_attention(
            q[start:end].float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale,
        )
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


class TorchAttentionBackend:
    """Reference backend: correct on any device, loops over prefill requests on the host."""

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] -> like q."""
        store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode_attention_ref(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                            meta.seq_lens[:nd], scale)
        if meta.num_prefills:
            cu = meta.cu_seqlens_q[nd:] - nd
            out[nd:] = prefill_attention_ref(q[nd:], k_cache, v_cache, meta.block_tables[nd:], cu,
                                             meta.seq_lens[nd:], scale)
        return out
