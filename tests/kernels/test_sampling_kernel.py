"""The Gumbel-max sampling kernel: greedy rows are argmax, draws follow softmax(logits / T), seeds decide."""

import math

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanovllm.kernels.sampling import gumbel_argmax  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402


def seeds(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64, device=DEVICE) * 7919 + 12345


def test_temperature_zero_is_argmax_with_ties_to_the_lowest_id():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g).to(DEVICE)
    logits[1, 17] = logits[1, 200] = 50.0  # a tie: the lower id wins, as torch.argmax
    logits[2, :] = 1.0  # all equal
    got = gumbel_argmax(logits, torch.zeros(6, device=DEVICE), seeds(6), block=64)
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[1] == 17 and got[2] == 0


def test_filtered_tokens_never_win_and_an_all_filtered_row_gives_zero():
    logits = torch.full((40, 50), float("-inf"), device=DEVICE)
    logits[:, 3] = 0.0
    logits[:, 41] = 0.5
    logits[39] = float("-inf")
    got = gumbel_argmax(logits, torch.full((40,), 2.0, device=DEVICE), seeds(40), block=16)
    assert set(got[:39].tolist()) <= {3, 41} and set(got[:39].tolist()) == {3, 41}
    assert got[39] == 0


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 600),  # the interpreter runs programs one by one
                                         pytest.param(torch.bfloat16, 20000, marks=pytest.mark.gpu)])
def test_draws_follow_the_softmax_of_logits_over_temperature(dtype, rows):
    """Chi-square of one draw per row (distinct seeds) against softmax(logits / T) on 6 tokens, which a row
    splits into two chunks (tokens 0-3 and 4-5) that the reduction must weigh against each other."""
    temperature = 0.8
    base = torch.tensor([1.0, 0.0, -0.5, 1.5, 0.3, -1.0])
    logits = base.to(dtype).to(DEVICE).expand(rows, -1).contiguous()
    got = gumbel_argmax(logits, torch.full((rows,), temperature, device=DEVICE), seeds(rows), block=4, chunk=4)
    counts = torch.bincount(got.cpu(), minlength=6).double()
    expected = torch.softmax(base.to(dtype).double() / temperature, dim=0) * rows
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts, expected)  # 5 degrees of freedom: p ~ 0.001


def test_a_row_depends_on_its_seed_alone():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 1000, generator=g).to(DEVICE)
    temps = torch.full((8,), 1.0, device=DEVICE)
    first = gumbel_argmax(logits, temps, seeds(8))
    assert torch.equal(first, gumbel_argmax(logits, temps, seeds(8))), "same seeds, same tokens"
    # row 5 alone, with the same seed and logits, gives the same token as inside the batch
    alone = gumbel_argmax(logits[5:6].clone(), temps[:1], seeds(8)[5:6].clone())
    assert alone.item() == first[5].item()
    others = torch.stack([gumbel_argmax(logits, temps, seeds(8, start=100 * k)) for k in range(1, 6)])
    assert (others != first).any(), "other seeds draw other tokens"


def test_strided_rows_and_large_vocab():
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 5000, generator=g).to(DEVICE)
    view = wide[:, :4099]  # row stride 5000, vocabulary 4099 (not a multiple of the tile)
    got = gumbel_argmax(view, torch.zeros(3, device=DEVICE), seeds(3), block=1024)
    assert got.tolist() == view.argmax(dim=-1).tolist()
    assert math.isfinite(float(view.max()))


def test_chunks_reduce_to_the_argmax_with_ties_to_the_lowest_id():
    """300 tokens in chunks of 64 (tiles of 16) give what one tile over the whole row gives, and torch.argmax."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g).to(DEVICE)
    logits[1, 17] = logits[1, 200] = 50.0  # a tie across chunks 0 and 3
    logits[2, 20] = logits[2, 36] = 50.0  # a tie in one lane of two tiles of a chunk
    logits[3, 250] = logits[3, 130] = 50.0  # the later chunk holds the higher id
    logits[4] = float("-inf")
    logits[4, 299] = -5.0  # the only finite logit, in the last (partial) tile of the last chunk
    logits[5] = float("-inf")  # all filtered: token 0
    temps = torch.zeros(6, device=DEVICE)
    temps[4] = temps[5] = 1.0  # sampled rows: the noise cannot move a lone finite logit
    chunked = gumbel_argmax(logits, temps, seeds(6), block=16, chunk=64)
    whole = gumbel_argmax(logits, temps, seeds(6), block=512)
    assert chunked.tolist() == whole.tolist() == logits.argmax(dim=-1).tolist()
    assert chunked.tolist()[1:] == [17, 20, 130, 299, 0]


def test_the_draw_does_not_depend_on_tile_or_chunk_size():
    g = torch.Generator().manual_seed(4)
    logits = (0.5 * torch.randn(4, 200, generator=g)).to(DEVICE)  # flat: the noise decides
    temps = torch.tensor([1.0, 0.7, 2.0, 1.0], device=DEVICE)
    draws = [gumbel_argmax(logits, temps, seeds(4), block=block, chunk=chunk).tolist()
             for block, chunk in [(4, 8), (16, 64), (32, 32), (256, None)]]
    assert all(d == draws[0] for d in draws), draws


@triton.jit
def _philox_uniforms(out_ptr, seed, COUNTERS: tl.constexpr):
    """The 4 uniforms of each counter, output j of counter c at 4c + j."""
    c = tl.arange(0, COUNTERS)
    u0, u1, u2, u3 = tl.rand4x(seed, c)
    tl.store(out_ptr + 4 * c, u0)
    tl.store(out_ptr + 4 * c + 1, u1)
    tl.store(out_ptr + 4 * c + 2, u2)
    tl.store(out_ptr + 4 * c + 3, u3)


def test_token_t_takes_output_t_mod_4_of_philox_counter_t_div_4():
    """The draw is argmax(logits / T + G), G = -log(-log u), u from the row's seed and the token id alone."""
    rows, vocab = 4, 257
    g = torch.Generator().manual_seed(5)
    logits = (0.5 * torch.randn(rows, vocab, generator=g)).to(DEVICE)
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0], device=DEVICE)
    row_seeds = seeds(rows)
    counters = triton.next_power_of_2(triton.cdiv(vocab, 4))
    expected = []
    for row in range(rows):
        u = torch.empty(4 * counters, device=DEVICE)
        _philox_uniforms[(1,)](u, int(row_seeds[row]), COUNTERS=counters)
        gumbel = -torch.log(-torch.log(u[:vocab].clamp_min(1e-10)))
        expected.append(int((logits[row] / temps[row] + gumbel).argmax()))
    assert gumbel_argmax(logits, temps, row_seeds, block=16, chunk=64).tolist() == expected


def test_more_chunks_than_one_reduction_tile():
    """150 chunks: the reduction walks its chunks in tiles; a tie across tiles goes to the lower id."""
    logits = torch.zeros(3, 600, device=DEVICE)
    logits[0, 13] = logits[0, 561] = 5.0  # chunk 3 (first tile) and chunk 140 (second tile)
    logits[1, 13] = 5.0
    logits[1, 598] = 6.0  # the last chunk wins outright
    logits[2, 590] = logits[2, 599] = 7.0  # a tie inside the second tile
    got = gumbel_argmax(logits, torch.zeros(3, device=DEVICE), seeds(3), block=4, chunk=4)
    assert got.tolist() == [13, 598, 590]


def _sample_by_slices(logits, temps, row_seeds, bounds, padding=0, **kwargs):
    """Each slice [lo, hi) of the vocabulary scored alone, as one tensor-parallel rank would, then merged."""
    from nanovllm.kernels.sampling import gumbel_argmax_with_scores, merge_shard_winners
    scores, ids = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        # a rank's slice may carry padding columns past the vocabulary: the kernel must not see them
        part = torch.cat([logits[:, lo:hi], torch.full((logits.shape[0], padding), 1e4, device=DEVICE)], dim=1)
        row_ids, row_scores = gumbel_argmax_with_scores(part[:, :hi - lo], temps, row_seeds, id_offset=lo, **kwargs)
        ids.append(row_ids)
        scores.append(row_scores)
    return merge_shard_winners(torch.stack(scores), torch.stack(ids))


@pytest.mark.parametrize("bounds", [(0, 152, 300), (0, 64, 100, 236, 300), (0, 300, 300)])
def test_vocabulary_slices_merge_to_the_whole_rows_tokens(bounds):
    """Tensor-parallel sampling: slices scored apart and merged draw exactly the tokens of the whole row."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(12, 300, generator=g) * 0.5).to(DEVICE)
    logits[0, 151] = logits[0, 152] = 40.0  # a tie across the first boundary: the lower id wins
    logits[1, :] = float("-inf")  # nothing allowed: token 0, as one device gives
    logits[2, 290] = 40.0  # the winner in the last slice
    temps = torch.tensor([0.0, 0.7, 0.0] + [0.6, 1.0, 1.5] * 3, device=DEVICE)
    whole = gumbel_argmax(logits, temps, seeds(12), block=16, chunk=32)
    assert whole[0] == 151 and whole[1] == 0 and whole[2] == 290
    assert _sample_by_slices(logits, temps, seeds(12), bounds, block=16, chunk=32).tolist() == whole.tolist()


def test_vocabulary_slices_draw_varied_tokens_like_the_whole_row():
    """Flat logits at a high temperature: many different tokens drawn, every one equal to the whole row's."""
    logits = torch.zeros(64, 96, device=DEVICE)
    temps = torch.ones(64, device=DEVICE)
    whole = gumbel_argmax(logits, temps, seeds(64), block=16, chunk=16)
    assert len(set(whole.tolist())) > 20, "noise must spread the draws"
    assert _sample_by_slices(logits, temps, seeds(64), (0, 48, 96), padding=4, block=16).tolist() == whole.tolist()


def test_a_slice_must_start_on_a_multiple_of_four():
    from nanovllm.kernels.sampling import gumbel_argmax_with_scores
    with pytest.raises(AssertionError, match="multiple of 4"):
        gumbel_argmax_with_scores(torch.zeros(1, 8, device=DEVICE), torch.ones(1, device=DEVICE), seeds(1),
                                  id_offset=6)
