"""Turn the scheduler's plain list of sequences into the step's tensors (vectorised, no per-token loops)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.engine.sequence import Sequence


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sample_rows] int64: rows of the hidden states that need logits
    sampled_seq_indices: list[int]  # which sequences of the batch get a token
    is_decode_only: bool
    # rows of sample_indices per sampled sequence (sampled_seq_indices order): 1, or 1 + its draft tokens
    sample_counts: list[int] = field(default_factory=list)


def needs_sample(seq: Sequence) -> bool:
    """Whether this step reaches the sequence's last token, so it must produce the next one."""
    return seq.num_cached_tokens + seq.num_scheduled_tokens - len(seq.draft_token_ids) == seq.num_tokens


def prepare_batch(seqs: list[Sequence], block_size: int, device: torch.device) -> StepBatch:
    """Inputs for one step. Sequences come decodes first; a decode's input is its last token, then its draft
    tokens when it verifies some.

    Every token of a decode is a decode row of the attention metadata: it attends to its request's tokens up to
    itself, with the request's block table. So a verify step of 1 + k tokens runs as 1 + k one-token decodes
    (the decode kernels and their CUDA graphs, no verify variant); every layer stores the step's K/V before any
    row reads the cache, so draft j's row sees the K/V of the drafts before it. Every row of a verifying
    request is sampled.

    Everything is computed with numpy over the whole batch, packed into two host buffers (int64 and int32)
    and sent with one non-blocking copy each (from pinned memory on CUDA).
    """
    num_seqs = len(seqs)
    query_lens = np.fromiter((s.num_scheduled_tokens for s in seqs), dtype=np.int64, count=num_seqs)
    context_lens = np.fromiter((s.num_cached_tokens for s in seqs), dtype=np.int64, count=num_seqs)
    seq_lens = context_lens + query_lens
    cu_seqlens = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_seqlens[1:])
    num_tokens = int(cu_seqlens[-1])

    # the leading decodes; a one-token prefill chunk may sit here too, and its token need not be the last one
    num_decodes = next((i for i, s in enumerate(seqs) if s.is_prefill and s.num_scheduled_tokens != 1), num_seqs)
    num_decode_rows = int(cu_seqlens[num_decodes])
    decode_ids = np.fromiter(itertools.chain.from_iterable(
        (s.token_ids[s.num_cached_tokens] if s.is_prefill else s.last_token, *s.draft_token_ids)
        for s in seqs[:num_decodes]), dtype=np.int64, count=num_decode_rows)
    prefill_ids = [s.token_ids[s.num_cached_tokens:s.num_cached_tokens + s.num_scheduled_tokens]
                   for s in seqs[num_decodes:]]
    input_ids = np.concatenate([decode_ids, *map(np.asarray, prefill_ids)]) if prefill_ids else decode_ids

    # position of each token = its request's context length + its index within the request's chunk
    token_seq = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.arange(num_tokens) - cu_seqlens[token_seq] + context_lens[token_seq]

    block_tables = _block_tables(seqs)
    slot_mapping = _slots(block_tables, token_seq, positions, block_size)

    # the attention's requests: one per decode row, then the prefill chunks
    attn_seq = np.concatenate([token_seq[:num_decode_rows], np.arange(num_decodes, num_seqs)])
    attn_query_lens = np.concatenate([np.ones(num_decode_rows, dtype=np.int64), query_lens[num_decodes:]])
    attn_seq_lens = np.concatenate([positions[:num_decode_rows] + 1, seq_lens[num_decodes:]])
    attn_cu = np.zeros(len(attn_seq) + 1, dtype=np.int64)
    np.cumsum(attn_query_lens, out=attn_cu[1:])

    sampled = [i for i, s in enumerate(seqs) if needs_sample(s)]
    counts = np.fromiter((1 + len(seqs[i].draft_token_ids) for i in sampled), dtype=np.int64, count=len(sampled))
    # each sampled sequence's last `count` rows
    firsts = cu_seqlens[1:][sampled] - counts
    sample_rows = np.repeat(firsts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
    batch = _pack(input_ids, positions, slot_mapping, attn_cu, attn_query_lens, attn_seq_lens,
                  block_tables[attn_seq], sample_rows, sampled, num_decode_rows, device)
    batch.sample_counts = counts.tolist()
    return batch


def prepare_decode_ahead(seqs: list[Sequence], source_rows: list[int], block_size: int,
                         device: torch.device, tables: DecodeBlockTables | None = None) -> StepBatch:
    """Inputs of a decode step planned while the previous step still runs (asynchronous scheduling).

    Each sequence has one token in flight: sampled by the previous step, not yet appended on the host. This
    step computes that token, at position ``num_tokens``, so the block manager must already hold a slot for it.
    Its id is only on the device: ``input_ids`` holds ``source_rows`` (row i: which row of the previous step's
    sampled tokens is sequence i's), for the runner to gather from there. ``tables``: the block tables kept
    from the planned step before (``DecodeBlockTables``).
    """
    num_seqs = len(seqs)
    positions = np.fromiter(map(attrgetter("num_tokens"), seqs), dtype=np.int64, count=num_seqs)
    seq_lens = positions + 1
    query_lens = np.ones(num_seqs, dtype=np.int64)
    cu_seqlens_q = np.arange(num_seqs + 1, dtype=np.int64)
    block_tables = tables.of(seqs) if tables is not None else _block_tables(seqs)
    slot_mapping = _slots(block_tables, np.arange(num_seqs), positions, block_size)
    rows = np.asarray(source_rows, dtype=np.int64)
    batch = _pack(rows, positions, slot_mapping, cu_seqlens_q, query_lens, seq_lens, block_tables,
                  np.arange(num_seqs), list(range(num_seqs)), num_seqs, device)
    batch.sample_counts = [1] * num_seqs
    return batch


class DecodeBlockTables:
    """The block tables of consecutive planned decode steps, kept across them.

    Between two planned steps a sequence's block table can only grow (a block for the token in flight): the
    scheduler preempts, allocates and trims only in steps scheduled the ordinary way, and those build their
    batch with ``prepare_batch``, after which ``reset`` must be called. So while a planned step holds the same
    sequences in the same order as the one before, only the rows whose table grew are written again.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._seqs: list[Sequence] | None = None
        self._tables = np.empty((0, 0), dtype=np.int32)
        self._lens = np.empty(0, dtype=np.int64)

    def of(self, seqs: list[Sequence]) -> np.ndarray:
        """[num_seqs, longest table] int32, as ``_block_tables(seqs)``; the caller copies it before the next call."""
        lens = np.fromiter(map(len, map(attrgetter("block_table"), seqs)), dtype=np.int64, count=len(seqs))
        if self._seqs is None or seqs != self._seqs:
            self._seqs, self._tables, self._lens = list(seqs), _block_tables(seqs), lens
            return self._tables
        grown = np.flatnonzero(lens != self._lens)
        if grown.size:
            width = int(lens.max())
            if width > self._tables.shape[1]:
                wider = np.full((len(seqs), width), -1, dtype=np.int32)
                wider[:, :self._tables.shape[1]] = self._tables
                self._tables = wider
            for i in grown.tolist():
                table = seqs[i].block_table
                self._tables[i, :len(table)] = table
            self._lens = lens
        return self._tables


def _block_tables(seqs: list[Sequence]) -> np.ndarray:
    """[num_seqs, longest table] int32, each row a sequence's block ids padded with -1."""
    table_lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=len(seqs))
    block_tables = np.full((len(seqs), int(table_lens.max())), -1, dtype=np.int32)
    block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(s.block_table for s in seqs), dtype=np.int32, count=int(table_lens.sum()))
    return block_tables


def _slots(block_tables: np.ndarray, token_seq: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each token: its sequence's block at position // block_size, then the offset in it."""
    return block_tables[token_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size


def _pack(input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, cu_seqlens_q: np.ndarray,
          query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, sample_rows: np.ndarray,
          sampled: list[int], num_decodes: int, device: torch.device) -> StepBatch:
    """The step's arrays as device tensors: two host buffers (int64 and int32), one copy each."""
    num_seqs, num_tokens = len(query_lens), len(input_ids)
    longs = _to_device(np.concatenate([input_ids, positions, slot_mapping, sample_rows]), device)
    ints = _to_device(np.concatenate([cu_seqlens_q.astype(np.int32), seq_lens.astype(np.int32),
                                      block_tables.ravel()]), device)
    input_ids_t, positions_t, slots_t, sample_t = longs.split([num_tokens, num_tokens, num_tokens, len(sample_rows)])
    cu_t, seq_lens_t, tables_t = ints.split([num_seqs + 1, num_seqs, block_tables.size])

    meta = AttentionMetadata(
        slot_mapping=slots_t,
        cu_seqlens_q=cu_t,
        seq_lens=seq_lens_t,
        block_tables=tables_t.view(block_tables.shape),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_lens_host=query_lens.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )
    return StepBatch(
        input_ids=input_ids_t,
        positions=positions_t,
        meta=meta,
        sample_indices=sample_t,
        sampled_seq_indices=sampled,
        is_decode_only=num_decodes == num_seqs,
    )


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
