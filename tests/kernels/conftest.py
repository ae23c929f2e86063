"""Kernel tests run on a GPU when there is one, else under the Triton CPU interpreter.

Also the ``paged_batch`` fixture: a random batch of requests over a paged KV cache.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Kernels pick the interpreter when they are decorated (at import of the kernel module), so set it
# before any test module imports one. Each test module skips itself when triton is not installed.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`pytest -m gpu` on a machine without CUDA: skip (bf16 dots are wrong under the interpreter)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    here = Path(__file__).parent
    for item in items:  # a session-wide hook: touch only this directory's tests
        if "gpu" in item.keywords and here in item.path.parents:
            item.add_marker(skip)


@dataclass
class PagedBatch:
    q: torch.Tensor             # [num_tokens, num_heads, head_dim], the chunk's queries
    k: torch.Tensor             # [num_tokens, num_kv_heads, head_dim], the chunk's new keys
    v: torch.Tensor
    k_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 past each request's blocks
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor      # [num_seqs] int32
    query_lens: list[int]
    context_lens: list[int]

    @property
    def max_seq_len(self) -> int:
        return max(q + c for q, c in zip(self.query_lens, self.context_lens, strict=True))


def make_paged_batch(query_lens: list[int], context_lens: list[int], *, num_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0,
                     store_chunk: bool = True, pool_blocks: int = 0, device: str = DEVICE) -> PagedBatch:
    """Requests get shuffled blocks of a cache in which every block no request owns is NaN, so a
    kernel that reads a wrong block poisons its output. Block 0 is never owned and stays finite,
    because the decode reference reads it for -1 table entries (with probability 0).
    With store_chunk, the chunk's own K/V are already in the cache (as the backend leaves them).
    pool_blocks makes a larger pool whose last blocks the requests own (offsets past 2**31 elements).
    """
    gen = torch.Generator().manual_seed(seed)  # host: block tables and slots
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # device: the (possibly large) tensors
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    needed = sum(blocks_per_seq)
    num_blocks = max(1 + needed + 3, pool_blocks)
    first = 1 if num_blocks == 1 + needed + 3 else num_blocks - needed
    owned = (torch.randperm(num_blocks - first, generator=gen) + first)[:needed].tolist()
    rows, start = [], 0
    for n in blocks_per_seq:
        rows.append(owned[start:start + n])
        start += n
    tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    for i, row in enumerate(rows):
        tables[i, :len(row)] = torch.tensor(row, dtype=torch.int32)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*shape), randn(*shape)
    unowned = torch.ones(num_blocks, dtype=torch.bool)
    unowned[[0, *owned]] = False
    k_cache[unowned.to(device)] = float("nan")
    v_cache[unowned.to(device)] = float("nan")

    num_tokens = sum(query_lens)
    slots = [row[pos // block_size] * block_size + pos % block_size
             for row, q_len, ctx in zip(rows, query_lens, context_lens, strict=True)
             for pos in range(ctx, ctx + q_len)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    if store_chunk:
        k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v
    cu = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    return PagedBatch(
        q=randn(num_tokens, num_heads, head_dim), k=k, v=v, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slot_mapping, block_tables=tables.to(device), cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens=list(query_lens), context_lens=list(context_lens),
    )


@pytest.fixture
def paged_batch():
    """The factory ``make_paged_batch`` (a fixture so test modules need not import conftest)."""
    return make_paged_batch


# Tolerances against the fp32-softmax torch reference, by input dtype.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@pytest.fixture
def tolerances():
    return TOLERANCES
