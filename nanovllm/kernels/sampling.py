"""Sampling a token per row in one pass over the logits: argmax(logits / temperature + Gumbel noise).

argmax(log p + G) with G ~ Gumbel(0, 1) i.i.d. is a sample from p (the Gumbel-max trick), and log p differs from
logits / temperature by a per-row constant, so no softmax is needed. The sampler's torch path computes the same
thing as argmax(p / E) with E ~ Exponential(1) (G = -log E); here the noise is generated inside the kernel from a
per-row seed (Philox, counter = token id), so a row's draw depends on its seed alone, never on the batch, and the
[rows, vocab] float32 temporaries of softmax and noise are never written. One program per row walks the vocabulary
in tiles, reading the logits once in their own dtype.

Rows with temperature 0 take the plain argmax. Ties go to the lowest token id, as torch.argmax. A logit of -inf
(a filtered token) never wins unless the whole row is -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,             # [rows, vocab], any float dtype, unit stride on vocab
    temperatures_ptr,       # [rows] float32, 0 = greedy
    seeds_ptr,              # [rows] int64: this step's seed of each row
    out_ptr,                # [rows] int64
    vocab_size,
    stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    inv_temperature = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))
    noise_scale = tl.where(greedy, 0.0, 1.0)
    seed = tl.load(seeds_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_ids = tl.full([BLOCK], 2147483647, tl.int32)
    row_logits = logits_ptr + row.to(tl.int64) * stride_row
    for start in range(0, vocab_size, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        valid = ids < vocab_size
        x = tl.load(row_logits + ids, mask=valid, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, ids)  # uniform in [0, 1): u = 0 gives -inf noise, never a NaN
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(x == float("-inf"), float("-inf"), x * inv_temperature + noise_scale * gumbel)
        score = tl.where(valid, score, float("-inf"))
        # strictly greater: within a lane the earlier (lower) id keeps a tie
        better = score > best
        best = tl.where(better, score, best)
        best_ids = tl.where(better, ids, best_ids)
    top = tl.max(best, 0)
    # lowest id among the lanes holding the maximum; an all -inf row gives token 0
    winner = tl.min(tl.where(best == top, best_ids, 2147483647), 0)
    winner = tl.where(winner == 2147483647, 0, winner)
    tl.store(out_ptr + row, winner.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  block: int = 2048) -> torch.Tensor:
    """logits: [rows, vocab]; temperatures: [rows] float32 (0 = greedy); seeds: [rows] int64 -> [rows] int64."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary must be contiguous"
    assert temperatures.shape == (rows,) and seeds.shape == (rows,) and seeds.dtype == torch.int64
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](logits, temperatures.float().contiguous(), seeds.contiguous(), out, vocab,
                                       logits.stride(0), BLOCK=min(block, triton.next_power_of_2(vocab)),
                                       num_warps=8)
    return out
