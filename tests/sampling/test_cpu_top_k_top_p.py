"""The CPU's top-k / top-p over each row's most likely tokens keeps exactly what the full sort keeps."""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers.sampler import apply_top_k_top_p
from nanovllm.platforms.cpu import sampler as cpu_sampler

VOCAB = 5000


def _logits(rows: int, seed: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    if ties:  # few distinct values: many equal logits, also at the candidates' edge
        logits = (logits * 2).round() / 2
    return logits


def _count_sorted_rows(monkeypatch) -> list[int]:
    sorted_rows = []

    def counting(logits, top_k, top_p, row_log_normaliser=None):
        sorted_rows.append(logits.shape[0])
        return apply_top_k_top_p(logits, top_k, top_p, row_log_normaliser)
    monkeypatch.setattr(cpu_sampler, "apply_top_k_top_p", counting)
    return sorted_rows


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ties", [False, True])
def test_same_tokens_kept_as_the_full_sort(monkeypatch, seed, ties):
    rows = 48
    logits = _logits(rows, seed, ties)
    g = torch.Generator().manual_seed(100 + seed)
    top_p = torch.rand(rows, generator=g) * 0.99 + 0.005
    top_p[::5] = 1.0  # top_k alone, or nothing, beside filtering rows
    top_k = torch.randint(0, 400, (rows,), generator=g)  # past the 256 candidates too
    top_k[::3] = 0
    logits[1] = 0.0  # a flat row: its nucleus is the whole vocabulary
    logits[2, VOCAB // 2:] = float("-inf")  # a row that min_p or a grammar has thinned
    logits[4] *= 0.01  # a nearly flat row
    sorted_rows = _count_sorted_rows(monkeypatch)
    for k in (None, top_k):
        expected = apply_top_k_top_p(logits, k, top_p)
        got = cpu_sampler.top_k_top_p(logits, k, top_p)
        assert torch.equal(got, expected)
    assert sum(sorted_rows) < rows, "most rows are decided among the candidates, without a sort"


def test_a_row_with_nothing_to_filter_is_left_as_it_is():
    logits = _logits(2, 7, False)
    got = cpu_sampler.top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([1.0, 0.5]))
    assert torch.equal(got[0], logits[0])
    assert torch.isinf(got[1]).sum() > 0


def test_a_small_vocabulary_is_sorted_whole(monkeypatch):
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))
    top_p = torch.tensor([0.3, 0.9, 1.0])
    sorted_rows = _count_sorted_rows(monkeypatch)
    assert torch.equal(cpu_sampler.top_k_top_p(logits, None, top_p), apply_top_k_top_p(logits, None, top_p))
    assert sorted_rows == [2], "the row with top_p 1 is left as it is"


def test_a_wide_nucleus_is_decided_among_more_candidates(monkeypatch):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, VOCAB, generator=g) * 0.1 - 10
    logits[:, :1000] += 15  # about 500 tokens in a nucleus of 0.5: more than the first width
    top_p = torch.tensor([0.5, 0.3, 0.9, 0.05])
    sorted_rows = _count_sorted_rows(monkeypatch)
    got = cpu_sampler.top_k_top_p(logits, None, top_p)
    assert torch.equal(got, apply_top_k_top_p(logits, None, top_p))
    assert (got[0] > float("-inf")).sum() > cpu_sampler.CANDIDATE_WIDTHS[0]
    assert sorted_rows == []
