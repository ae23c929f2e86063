"""The CPU's attention backend: the compiled C ops where they apply, torch ops over gathered slots otherwise.

Same results as attention/reference.py (up to float rounding). ``fuses_qkv`` takes a step of float32
activations over a float32, float16 or int8 cache to ``cpu_ops.rope_store_attention`` (q/k norm, RoPE, K/V store
and attention in one call, decodes and prefill chunks alike); any other step stores with ``index_copy_`` and
attends with ``scaled_dot_product_attention`` over the live slots only. What every layer of a step shares (the
decode requests' slots, each token's request and length for the compiled kernel) is planned once per step by
``prepare``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.kv_fp8 import as_bits, from_bits, to_cache
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.reference import store_kvcache_ref
from nanovllm.platforms.cpu import cpu_ops


# The torch path. Attention at batch 64 on a CPU is mostly memory traffic: the references copy whole blocks per
# request (`cache[block_table]`, a slow advanced index) and then run small batched matmuls; here each step
# gathers only the live slots, once per step's plan, with one index_select per layer, and one fused
# scaled_dot_product_attention (flash kernel) does the rest.
@dataclass
class DecodePlan:
    """Where the K/V of a step's decode requests sit in the cache, computed once per step for every layer."""

    slots: torch.Tensor  # [num_decodes * max_len] int64: cache slot of token j of request i at i * max_len + j
    valid: torch.Tensor | None  # [num_decodes, 1, 1, max_len] bool: j < seq_len; None: every request is max_len
    max_len: int
    # the first slot when a lone request's tokens fill consecutive slots (its blocks are consecutive): its K/V
    # are then a view of the cache, nothing to gather
    first_slot: int | None = None


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, block_size: int,
                seq_lens_host: list[int] | None = None) -> DecodePlan:
    """block_tables: [num_seqs, max_blocks] (ids < 0 are padding); seq_lens: [num_seqs]."""
    positions = torch.arange(max_len, device=block_tables.device)
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long().clamp_min(0)
    slots = table[:, positions // block_size] * block_size + positions % block_size  # [num_seqs, max_len]
    # a padding slot (past a request's seq_len) must be masked, unless there is none
    if seq_lens_host is not None and min(seq_lens_host) == max_len:
        valid = None
    else:
        valid = (positions[None, :] < seq_lens[:, None].long())[:, None, None, :]
    first_slot = None
    if len(table) == 1:
        blocks = table[0].tolist()
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            first_slot = blocks[0] * block_size
    return DecodePlan(slots.reshape(-1), valid, max_len, first_slot)


def decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                         scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """decode_attention_ref's result. q: [num_seqs, num_heads, head_dim] -> like q. K's scale folds into the
    softmax scale and V's into the output, as in the Triton kernels."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # [num_seqs, num_kv_heads, max_len, head_dim] views of one gathered copy (or of the cache itself)
    if plan.first_slot is not None:
        keys = k_cache.view(-1, num_kv_heads, head_dim).narrow(0, plan.first_slot, plan.max_len)
        values = v_cache.view(-1, num_kv_heads, head_dim).narrow(0, plan.first_slot, plan.max_len)
    else:
        keys = from_bits(as_bits(k_cache).view(-1, num_kv_heads, head_dim).index_select(0, plan.slots), k_cache.dtype)
        values = from_bits(as_bits(v_cache).view(-1, num_kv_heads, head_dim).index_select(0, plan.slots),
                           v_cache.dtype)
    # a lower-precision cache (kv_cache_dtype) is read back in the activations' dtype
    keys = keys.view(num_seqs, plan.max_len, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    values = values.view(num_seqs, plan.max_len, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    # the query heads of one KV head are that head's "query tokens": GQA without repeating K/V
    group = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=plan.valid, scale=scale * k_scale)
    if v_scale != 1.0:
        out = out * v_scale
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)  # a fully masked row (seq_len 0) gives 0


def prefill_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int],
                          seq_lens: list[int], scale: float, k_scale: float = 1.0, v_scale: float = 1.0
                          ) -> torch.Tensor:
    """prefill_attention_ref's result; a request with no cached context attends over its own k, v (rounded as
    the cache holds them), never reading the cache. q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens,
    num_kv_heads, head_dim]."""
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        end = start + query_len
        context_len = seq_len - query_len
        if context_len == 0:
            keys, values = to_cache(k[start:end], k_cache.dtype, k_scale), to_cache(v[start:end], v_cache.dtype, v_scale)
            mask = None
        else:
            positions = torch.arange(seq_len, device=q.device)
            slots = block_tables[i].long()[positions // block_size] * block_size + positions % block_size
            keys = from_bits(as_bits(k_cache).view(-1, num_kv_heads, head_dim).index_select(0, slots), k_cache.dtype)
            values = from_bits(as_bits(v_cache).view(-1, num_kv_heads, head_dim).index_select(0, slots),
                               v_cache.dtype)
            mask = positions[None, :] <= positions[context_len:, None]  # [query_len, seq_len]
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a lower-precision cache: read back in q's dtype
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=mask is None, scale=scale * k_scale, enable_gqa=True)
        if v_scale != 1.0:
            o = o * v_scale
        out[start:end] = o.transpose(0, 1).to(q.dtype)
        start = end
    return out


def store_kvcache_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """store_kvcache_ref when every slot is >= 0: one index_copy_ each, no boolean mask."""
    for x, cache, x_scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        as_bits(cache).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping,
                                                              as_bits(to_cache(x, cache.dtype, x_scale)))


def token_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of a step: its request (row of the block tables) and how many tokens it attends to (causal:
    its position + 1), both [num_tokens] int32, as the compiled CPU attention reads them."""
    seqs: list[int] = []
    lens: list[int] = []
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        seqs += [i] * query_len
        lens += range(seq_len - query_len + 1, seq_len + 1)
    return torch.tensor(seqs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


class _StepPlan:
    """One step's shared values, each derived on first use: a step reads the decode plan and the slots' check
    (the torch path) or the token rows (the compiled path with prefill chunks), seldom both."""

    def __init__(self, meta: AttentionMetadata, block_size: int) -> None:
        self.meta = meta  # the step it belongs to (every layer of a step gets the same object)
        self.block_size = block_size

    @cached_property
    def all_slots_valid(self) -> bool:
        slots = self.meta.slot_mapping
        return slots.numel() == 0 or bool(slots.min() >= 0)

    @cached_property
    def decode(self) -> DecodePlan | None:
        meta, nd = self.meta, self.meta.num_decodes
        if not nd:
            return None
        return decode_plan(meta.block_tables[:nd], meta.seq_lens[:nd], max(meta.seq_lens_host[:nd]),
                           self.block_size, meta.seq_lens_host[:nd])

    @cached_property
    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        return token_rows(self.meta)


class CpuAttentionBackend(AttentionBackend):
    """``attention_backend="torch"`` on the CPU (the default there)."""

    name = "torch"

    def __init__(self) -> None:
        self._step: _StepPlan | None = None

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """The step's plan, shared by its layers; its parts are built when a layer first needs them."""
        self._step = _StepPlan(meta, block_size)

    def _plan(self, meta: AttentionMetadata) -> _StepPlan:
        if self._step is None or self._step.meta is not meta:
            raise RuntimeError("CpuAttentionBackend: prepare(meta, block_size) was not called for this step")
        return self._step

    def fuses_qkv(self, rotary, head_dim: int, k_cache: torch.Tensor, meta: AttentionMetadata | None,
                  qkv: torch.Tensor | None = None) -> bool:
        """A step of float32 activations and a float32, float16 or int8 cache, with the compiled ops built."""
        return (meta is not None and qkv is not None and rotary.cos.shape[-1] == head_dim
                and cpu_ops.usable(qkv, rotary.cos) and cpu_ops.kv_cache_usable(k_cache))

    def compiled_rows(self, meta: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(row_seq, attend_lens) of the step as the compiled kernel reads them: see cpu_ops.rope_store_attention."""
        if meta.num_prefills:
            return self._plan(meta).token_rows
        return None, meta.seq_lens  # a decode step: row r is request r, and attends to its whole sequence

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm, k_norm, num_heads: int,
                    num_kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """The compiled kernel. Its caches are never fp8 (kv_cache_usable), so k_scale and v_scale are 1.0."""
        assert k_scale == v_scale == 1.0, "the compiled CPU attention takes no fp8 cache"
        row_seq, attend_lens = self.compiled_rows(meta)
        return cpu_ops.rope_store_attention(
            qkv, positions, rotary.cos, rotary.sin, None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight, 0.0 if q_norm is None else q_norm.eps, k_cache, v_cache,
            meta.block_tables, attend_lens, meta.slot_mapping, num_heads, num_kv_heads, scale, row_seq)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        if k_cache.dtype == torch.int8:  # only forward_qkv's compiled kernel reads its rows' scales
            raise ValueError(f"kv_cache_dtype 'int8' needs the compiled CPU attention, which this step cannot use "
                             f"(activations {q.dtype} on {q.device}): use kv_cache_dtype 'auto'.")
        plan = self._plan(meta)
        if plan.all_slots_valid:
            store_kvcache_cpu(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        else:
            store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        nd = meta.num_decodes
        if not meta.num_prefills:
            return decode_attention_cpu(q, k_cache, v_cache, plan.decode, scale, k_scale, v_scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode_attention_cpu(q[:nd], k_cache, v_cache, plan.decode, scale, k_scale, v_scale)
        out[nd:] = prefill_attention_cpu(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta.block_tables[nd:],
                                         meta.query_lens_host[nd:], meta.seq_lens_host[nd:], scale, k_scale,
                                         v_scale)
        return out
