"""Sampling a token per row in one pass over the logits: argmax(logits / temperature + Gumbel noise).

argmax(log p + G) with G ~ Gumbel(0, 1) i.i.d. is a sample from p (the Gumbel-max trick), and log p differs from
logits / temperature by a per-row constant, so no softmax is needed. The sampler's torch path computes the same
thing as argmax(p / E) with E ~ Exponential(1) (G = -log E); here the noise is generated inside the kernel from a
per-row seed, so the [rows, vocab] float32 temporaries of softmax and noise are never written, and the logits are
read once in their own dtype.

Noise: token t takes output t % 4 of Philox(seed, counter t // 4). One Philox call gives 4 values, so a tile of
BLOCK tokens costs BLOCK / 4 calls, and a token's noise depends on its seed and id alone: not on the batch, the
other rows, or how the work is split below.

Two kernels. One program per (row, chunk of the vocabulary) scans its chunk in tiles and writes the chunk's best
(score, id); many such programs fill the GPU at any batch size, where one program per row left most SMs idle for
small batches and ran in few, long waves for large ones. Then one program per row reduces its chunks. The grids
depend on shapes alone, so a call can be captured in a CUDA graph.

Tensor parallel: a rank holding a slice of the vocabulary scores only its slice (``id_offset`` = the global id of
its first column, a multiple of 4 so that each token keeps its Philox output) and returns its best (score, id);
the best of those over the ranks is the token one device would have drawn from the whole row
(``merge_shard_winners``).

Rows with temperature 0 take the plain argmax (no noise is drawn). Ties go to the lowest token id, as torch.argmax.
A logit of -inf (a filtered token) never wins unless the whole row is -inf, which gives token 0. Neither the tile
nor the chunk size changes the token drawn: the reduction keeps the highest score and, among equal scores, the
lowest id, whatever the order it sees them in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanovllm.kernels.jit import jit_unspecialized

_NO_ID = tl.constexpr(2147483647)  # an id above any token: a lane or chunk that saw only -inf
_TARGET_PROGRAMS = 8192  # (row, chunk) programs to aim for: several waves over the 132 SMs of an H200
_MAX_CHUNK = 16384
_REDUCE_BLOCK = 128  # chunks per tile of the reduction; one compiled variant whatever the chunk count


# chunk sizes and counts follow the batch's row count: compiled as plain ints, or each new batch size range would
# compile another variant in the middle of serving
@jit_unspecialized("num_chunks", "chunk_size")
def _chunk_argmax_kernel(
    logits_ptr,             # [rows, vocab], any float dtype, unit stride on vocab
    temperatures_ptr,       # [rows] float32, 0 = greedy
    seeds_ptr,              # [rows] int64: this step's seed of each row
    scores_ptr,             # [rows, num_chunks] float32: each chunk's best score
    ids_ptr,                # [rows, num_chunks] int32: its token, _NO_ID if the chunk is all -inf
    vocab_size,             # columns of this row (of this rank's slice)
    id_offset,              # global id of column 0: 0, or where this rank's slice starts (a multiple of 4)
    stride_row,
    num_chunks,
    chunk_size,             # tokens per program, a multiple of BLOCK
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,  # libdevice's approximate log (GPU only; the interpreter has no libdevice)
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + row)
    row_logits = logits_ptr + row.to(tl.int64) * stride_row
    # A tile is [BLOCK // 4, 4]: lane (i, j) holds token start + 4i + j, so row i of the tile shares one Philox call
    # (counter start // 4 + i) and column j takes its j-th output.
    QUARTER: tl.constexpr = BLOCK // 4
    quads = tl.arange(0, QUARTER)
    lanes = 4 * quads[:, None] + tl.arange(0, 4)[None, :]
    best = tl.full([QUARTER, 4], float("-inf"), tl.float32)
    best_ids = tl.full([QUARTER, 4], _NO_ID, tl.int32)
    lo = chunk * chunk_size
    hi = tl.minimum(lo + chunk_size, vocab_size)
    for start in range(lo, hi, BLOCK):
        columns = start + lanes
        ids = id_offset + columns
        # chunks end on tile boundaries, so only the row's end is masked (which keeps the loads vectorized)
        score = tl.load(row_logits + columns, mask=columns < vocab_size, other=float("-inf")).to(tl.float32)
        if not greedy:  # greedy rows draw no noise
            r0, r1, r2, r3 = tl.randint4x(seed, (id_offset + start) // 4 + quads)
            u = tl.uint_to_uniform_float(tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [QUARTER, 4]))
            u = tl.maximum(u, 1e-10)  # u = 0 would give -inf noise: a lone finite logit could lose to token 0
            e = -tl.log(u)  # exact: winners have u near 1, where an approximate log loses e's digits
            # the outer log may be approximate (~1e-7 off, below a logit's rounding): 1 instruction instead of ~20,
            # and with 4 values per Philox call the logs are most of the work per token
            if FAST_LOG:
                gumbel = -libdevice.fast_logf(e)
            else:
                gumbel = -tl.log(e)
            score = tl.where(score == float("-inf"), score, score * inv_temperature + gumbel)
        # strictly greater: within a lane the earlier (lower) id keeps a tie; -inf and NaN never enter
        better = score > best
        best = tl.where(better, score, best)
        best_ids = tl.where(better, ids, best_ids)
    top = tl.max(best)
    # lowest id among the lanes holding the maximum
    winner = tl.min(tl.where(best == top, best_ids, _NO_ID))
    tl.store(scores_ptr + row * num_chunks + chunk, top)
    tl.store(ids_ptr + row * num_chunks + chunk, winner)


@jit_unspecialized("num_chunks")
def _reduce_chunks_kernel(scores_ptr, ids_ptr, out_ptr, best_score_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr):
    """Per row: the highest chunk score and the lowest id among equal scores; an all -inf row gives token 0."""
    row = tl.program_id(0)
    best = tl.full([BLOCK_CHUNKS], float("-inf"), tl.float32)
    best_ids = tl.full([BLOCK_CHUNKS], _NO_ID, tl.int32)
    for start in range(0, num_chunks, BLOCK_CHUNKS):
        offs = start + tl.arange(0, BLOCK_CHUNKS)
        valid = offs < num_chunks
        scores = tl.load(scores_ptr + row * num_chunks + offs, mask=valid, other=float("-inf"))
        ids = tl.load(ids_ptr + row * num_chunks + offs, mask=valid, other=_NO_ID)
        # chunks in increasing id order: strictly greater keeps the lower id of a tie within a lane
        better = scores > best
        best = tl.where(better, scores, best)
        best_ids = tl.where(better, ids, best_ids)
    top = tl.max(best)
    winner = tl.min(tl.where(best == top, best_ids, _NO_ID))
    winner = tl.where(winner == _NO_ID, 0, winner)
    tl.store(out_ptr + row, winner.to(tl.int64))
    tl.store(best_score_ptr + row, top)


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  block: int = 1024, chunk: int | None = None) -> torch.Tensor:
    """logits: [rows, vocab]; temperatures: [rows] float32 (0 = greedy); seeds: [rows] int64 -> [rows] int64.

    block (tokens per tile) and chunk (tokens per program, a multiple of the tile) only change the speed, never
    the tokens drawn; by default chunks are sized so that rows x chunks is about _TARGET_PROGRAMS.
    """
    return gumbel_argmax_with_scores(logits, temperatures, seeds, block=block, chunk=chunk)[0]


def gumbel_argmax_with_scores(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                              id_offset: int = 0, block: int = 1024,
                              chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``gumbel_argmax``, with each row's winning score too ([rows] float32, -inf for an all -inf row).

    id_offset: the global token id of column 0 (a multiple of 4): the ids returned, and the noise drawn, are those
    of the whole vocabulary, so that ``merge_shard_winners`` over the slices gives the whole row's token.
    """
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary must be contiguous"
    assert temperatures.shape == (rows,) and seeds.shape == (rows,) and seeds.dtype == torch.int64
    assert block >= 4 and block & (block - 1) == 0, "block: a power of two, at least 4"
    assert id_offset % 4 == 0, "a slice starts on a multiple of 4 (4 tokens share one Philox call)"
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    best_scores = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if not rows:
        return out, best_scores
    block = max(4, min(block, triton.next_power_of_2(max(vocab, 1))))
    if chunk is None:
        chunk = triton.next_power_of_2(max(1, triton.cdiv(rows * vocab, _TARGET_PROGRAMS)))
        chunk = max(block, min(chunk, _MAX_CHUNK))
    else:
        block = min(block, chunk)
    assert chunk % block == 0, "chunk: a multiple of the tile"
    num_chunks = max(1, triton.cdiv(vocab, chunk))
    scores = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits, temperatures.float().contiguous(), seeds.contiguous(), scores, ids, vocab, id_offset,
        logits.stride(0), num_chunks, chunk, BLOCK=block, FAST_LOG=not triton.knobs.runtime.interpret,
        num_warps=max(1, min(8, block // 256)))
    _reduce_chunks_kernel[(rows,)](scores, ids, out, best_scores, num_chunks, BLOCK_CHUNKS=_REDUCE_BLOCK)
    return out, best_scores


def merge_shard_winners(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """scores, ids: [slices, rows], each slice's winner (slices in vocabulary order) -> [rows] int64 token ids.

    The highest score wins and, among equal scores, the lowest id, as within one slice; rows that are -inf
    everywhere give token 0 (every slice reports 0 for them), as one device would.
    """
    best = scores.amax(dim=0, keepdim=True)
    return torch.where(scores == best, ids.long(), torch.iinfo(torch.int64).max).amin(dim=0)
