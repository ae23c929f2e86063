"""The oracle of paged attention: storing K/V into the cache and attending over it in plain, readable torch.

Every backend (attention/torch_backend.py, platforms/cpu/attention.py, attention/triton_backend.py) and every
kernel is tested against these functions, and benchmarks time them as the baseline. They run on any device and
favour clarity over speed: each request's blocks are copied whole, softmax in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.attention.kv_fp8 import to_cache


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each token's K/V into its cache slot; slots < 0 are skipped.

    k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale, v_scale: an fp8 cache's scales (attention/kv_fp8.py); other caches take 1.0
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache(k[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache(v[keep], v_cache.dtype, v_scale)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one request from the paged cache: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, kvh, hd]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query token per request, batched with padding.

    q: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs]
    k_scale, v_scale: the cache holds K / k_scale and V / v_scale (an fp8 cache; else 1.0)
    returns [num_seqs, num_heads, head_dim] in q's dtype (softmax in float32)
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long().clamp(0, k_cache.shape[0] - 1)  # padding ids: never used
    keys = k_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].float() * k_scale
    values = v_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].float() * v_scale
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
                          scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each request's query chunk over its cached context plus itself.

    q: [num_tokens, num_heads, head_dim] (requests packed by cu_seqlens_q); the chunk's own K/V must already
    be in the cache. Query i of a request sits at absolute position context_len + i and sees keys 0..that.
    k_scale, v_scale: as decode_attention_ref's.
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
        keys = gather_kv(k_cache, block_tables[i], seq_len).float() * k_scale
        values = gather_kv(v_cache, block_tables[i], seq_len).float() * v_scale
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
