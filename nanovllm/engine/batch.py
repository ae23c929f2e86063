"""Turn the scheduler's plain list of sequences into the step's tensors (vectorised, no per-token loops)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.engine.sequence import Sequence


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled] int64: rows of the hidden states that need logits
    sampled_seq_indices: list[int]  # which sequences of the batch get a token
    is_decode_only: bool


def needs_sample(seq: Sequence) -> bool:
    """Whether this step reaches the sequence's last token, so it must produce the next one."""
    return seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens


def prepare_batch(seqs: list[Sequence], block_size: int, device: torch.device) -> StepBatch:
    """Inputs for one step. Sequences come decodes first; a decode's input is its last token."""
    num_seqs = len(seqs)
    query_lens = np.fromiter((s.num_scheduled_tokens for s in seqs), dtype=np.int64, count=num_seqs)
    context_lens = np.fromiter((s.num_cached_tokens for s in seqs), dtype=np.int64, count=num_seqs)
    seq_lens = context_lens + query_lens
    cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])

    input_ids = np.empty(num_tokens, dtype=np.int64)
    for i, seq in enumerate(seqs):
        start, end = cu_seqlens_q[i], cu_seqlens_q[i + 1]
        if seq.is_prefill:
            input_ids[start:end] = seq.token_ids[seq.num_cached_tokens:seq.num_cached_tokens + seq.num_scheduled_tokens]
        else:
            input_ids[start] = seq.last_token

    # position of each token = its request's context length + its index within the request's chunk
    token_seq = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.arange(num_tokens) - cu_seqlens_q[token_seq] + context_lens[token_seq]

    max_blocks = max(len(s.block_table) for s in seqs)
    block_tables = np.full((num_seqs, max_blocks), -1, dtype=np.int32)
    for i, seq in enumerate(seqs):
        block_tables[i, :len(seq.block_table)] = seq.block_table
    slot_mapping = block_tables[token_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size

    num_decodes = 0
    while num_decodes < num_seqs and query_lens[num_decodes] == 1:
        num_decodes += 1
    sampled = [i for i, s in enumerate(seqs) if needs_sample(s)]
    sample_rows = cu_seqlens_q[1:][sampled] - 1

    pin = device.type == "cuda"

    def to_device(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if pin:
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=to_device(slot_mapping),
        cu_seqlens_q=to_device(cu_seqlens_q.astype(np.int32)),
        seq_lens=to_device(seq_lens.astype(np.int32)),
        block_tables=to_device(block_tables),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_lens_host=query_lens.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )
    return StepBatch(
        input_ids=to_device(input_ids),
        positions=to_device(positions),
        meta=meta,
        sample_indices=to_device(np.asarray(sample_rows, dtype=np.int64)),
        sampled_seq_indices=sampled,
        is_decode_only=num_decodes == num_seqs,
    )
