"""The per-step description of the batch that attention layers read, and the scoped forward context.

Index sketch for one request in a step (``|`` marks block boundaries of the paged cache)::

    tokens:   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
              <---- context_len ----->  <- query_len ->
              (K/V already in the cache)  (computed this step)
              <------------------ seq_len -------------->

``seq_len = context_len + query_len``. A decode request has ``query_len == 1``.
The batch is ordered decodes first: requests ``[0, num_decodes)`` each have one query token,
the rest are prefill chunks (any ``query_len >= 1``, any ``context_len >= 0``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: cache slot of each token of the step (block_id * block_size + offset); -1 = skip
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: prefix sums of query_len (the tokens of request i are cu_seqlens_q[i]:cu_seqlens_q[i+1])
    cu_seqlens_q: torch.Tensor
    # [num_seqs] int32: context_len + query_len of each request
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks] int32: the block table of each request, padded with -1... or any id
    block_tables: torch.Tensor
    num_decodes: int  # requests [0, num_decodes) are single-token decodes
    num_decode_tokens: int  # == num_decodes
    max_query_len: int
    max_seq_len: int
    # host copies (python ints) for backends that loop on the host (the torch reference)
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes


_forward_context: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Install the step's attention metadata for the duration of one model forward. Never nested."""
    global _forward_context
    assert _forward_context is None, "forward contexts do not nest"
    _forward_context = metadata
    try:
        yield metadata
    finally:
        _forward_context = None


def peek_forward_context() -> AttentionMetadata | None:
    """The current step's metadata, or None outside a model forward."""
    return _forward_context


def get_forward_context() -> AttentionMetadata:
    assert _forward_context is not None, "attention ran outside `with forward_context(...)`"
    return _forward_context
