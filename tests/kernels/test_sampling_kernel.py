"""The Gumbel-max sampling kernel: greedy rows are argmax, draws follow softmax(logits / T), seeds decide."""

import math

import pytest
import torch

pytest.importorskip("triton")

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


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 600),  # the interpreter runs rows one by one
                                         pytest.param(torch.bfloat16, 20000, marks=pytest.mark.gpu)])
def test_draws_follow_the_softmax_of_logits_over_temperature(dtype, rows):
    """Chi-square of one draw per row (distinct seeds) against softmax(logits / T) on 6 tokens."""
    temperature = 0.8
    base = torch.tensor([1.0, 0.0, -0.5, 1.5, 0.3, -1.0])
    logits = base.to(dtype).to(DEVICE).expand(rows, -1).contiguous()
    got = gumbel_argmax(logits, torch.full((rows,), temperature, device=DEVICE), seeds(rows), block=4)
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
