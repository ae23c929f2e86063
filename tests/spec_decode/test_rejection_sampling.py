"""Verifying a draft keeps the target distribution: a chi-square test on a tiny vocabulary, and verify rows see
their draft prefix as history (penalties, min_tokens)."""

from __future__ import annotations

import torch

from nanovllm.engine.sampling import build_sampling_tensors
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.spec_decode.acceptance import accepted_tokens
from nanovllm.layers.sampler import Sampler, SamplingTensors, apply_top_k
from nanovllm.sampling_params import SamplingParams

# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails with probability 1e-3
# per check, and the seeds are fixed, so the test is deterministic
CHI2_CRITICAL = {2: 13.82, 3: 16.27}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was produced"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def verify_many(logits: torch.Tensor, draft: list[int], num: int, params: SamplingTensors) -> list[list[int]]:
    """Run ``num`` independent verify steps of ``draft`` whose rows have the given logits."""
    rows = logits.repeat(num, 1)
    sampled = Sampler()(rows, params, torch.Generator().manual_seed(0)).token_ids.view(num, -1).tolist()
    return [accepted_tokens(draft, s) for s in sampled]


def test_verify_keeps_the_target_distribution_at_every_position():
    # position 0: the distribution after the newest token; position 1: after the draft token d0 = 1
    logits = torch.tensor([[1.0, 0.3, -0.5, 0.8], [0.2, -1.0, 0.9, 0.0]])
    num, temperature = 40_000, 0.9
    for top_k, d0 in ((0, 1), (3, 1), (0, 2)):
        params = SamplingTensors(temperatures=torch.full((2 * num,), temperature))
        if top_k:
            params.top_k, params.max_top_k = torch.full((2 * num,), top_k), top_k
        target = apply_top_k(logits / temperature, torch.full((2,), top_k), top_k) if top_k else logits / temperature
        target = target.softmax(dim=-1)
        outputs = verify_many(logits, [d0], num, params)
        first = torch.bincount(torch.tensor([o[0] for o in outputs]), minlength=4).float()
        df = int((target[0] > 0).sum()) - 1
        assert chi_square(first, target[0]) < CHI2_CRITICAL[df], (first, target[0])
        # the second token exists exactly when d0 was accepted, and then follows position 1's distribution
        seconds = [o[1] for o in outputs if len(o) == 2]
        assert all(o[0] == d0 for o in outputs if len(o) == 2)
        assert sum(o[0] == d0 for o in outputs) == len(seconds)
        second = torch.bincount(torch.tensor(seconds), minlength=4).float()
        df = int((target[1] > 0).sum()) - 1
        assert chi_square(second, target[1]) < CHI2_CRITICAL[df], (second, target[1])


def test_a_wrong_rule_fails_the_test():
    """The test above can fail: always keeping the draft changes the first token's distribution."""
    logits = torch.tensor([[1.0, 0.3, -0.5, 0.8], [0.2, -1.0, 0.9, 0.0]])
    num = 20_000
    rows = logits.repeat(num, 1)
    sampled = Sampler()(rows, torch.ones(2 * num), torch.Generator().manual_seed(0)).token_ids.view(num, -1)
    wrong = torch.bincount(torch.full((num,), 1), minlength=4).float()  # "accept d0 = 1 always"
    assert chi_square(wrong, logits[0].softmax(-1)) > CHI2_CRITICAL[3]
    right = torch.bincount(sampled[:, 0], minlength=4).float()
    assert chi_square(right, logits[0].softmax(-1)) < CHI2_CRITICAL[3]


def test_verify_rows_count_their_draft_prefix_as_generated():
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.2,
                            min_tokens=3, stop_token_ids=[9])
    seq = Sequence([4, 5, 6], params)
    seq.append_token(7)
    seq.extras.min_tokens_stop_ids = (2, 9)
    drafts = [[], [8], [8, 7]]
    rows = build_sampling_tensors([seq] * 3, 12, torch.device("cpu"), None, drafts)
    for j, draft in enumerate(drafts):
        plain = Sequence([4, 5, 6], params)
        plain.extras.min_tokens_stop_ids = (2, 9)
        for t in [7, *draft]:
            plain.append_token(t)
        alone = build_sampling_tensors([plain], 12, torch.device("cpu"))
        assert torch.equal(rows.output_counts[j], alone.output_counts[0])
        assert torch.equal(rows.prompt_mask[j], alone.prompt_mask[0])
        banned = sorted(rows.banned_tokens[rows.banned_rows == j].tolist())
        expected = sorted(alone.banned_tokens.tolist()) if alone.banned_rows is not None else []
        assert banned == expected
    assert sorted(rows.banned_rows.tolist()) == [0, 0, 1, 1]  # 1 + 1 generated < 3; 1 + 2 is not
