"""The batched sampler against direct references: filtered distributions, penalties, logprobs, seeds."""

import math

import numpy as np
import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.engine.sampling import build_sampling_tensors
from nanovllm.engine.sequence import Sequence
from nanovllm.layers import sampler as sampler_module
from nanovllm.layers.sampler import Sampler, SamplingTensors, apply_penalties, inverse_cdf_sample

CPU = torch.device("cpu")
# A tiny vocabulary. At temperature 1 the distribution is PROBS ** 1.7 renormalised (0.42, 0.25, 0.14, 0.09,
# 0.05, ...): every filter setting below decides with a margin, never on a rounding boundary.
PROBS = [0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.04, 0.01]
LOGITS = torch.tensor([math.log(p) for p in PROBS]) * 1.7 + 0.3  # arbitrary scale and shift: T matters
# chi-square 0.9999 quantiles by degrees of freedom: a correct sampler with fixed seeds stays far below
CHI2_LIMIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def seq_with(params: SamplingParams, prompt=(5,), output=()) -> Sequence:
    seq = Sequence(list(prompt), params)
    for t in output:
        seq.append_token(t)
    return seq


def reference_distribution(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """What a row should sample from, computed directly in float64: temperature, min_p, top_k, top_p."""
    x = logits.double().numpy()
    if p.greedy:
        out = np.zeros_like(x)
        out[x.argmax()] = 1
        return out
    probs = np.exp(x / p.temperature - (x / p.temperature).max())
    probs /= probs.sum()
    keep = np.ones_like(probs, dtype=bool)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    order = np.argsort(-probs)
    if p.top_k > 0:
        keep[order[p.top_k:]] = False
    if p.top_p < 1:
        kept = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
        mass, chosen = 0.0, np.zeros_like(keep)
        for i in order:
            if not keep[i]:
                continue
            chosen[i] = True
            mass += kept[i]
            if mass >= p.top_p:
                break
        keep &= chosen
    out = np.where(keep, probs, 0)
    return out / out.sum()


def tile(tensors: SamplingTensors, times: int) -> SamplingTensors:
    """The batch repeated ``times`` over (row r of copy c is row c * B + r): many draws in one call."""
    def rep(t):
        return None if t is None else t.repeat(times)
    return SamplingTensors(temperatures=rep(tensors.temperatures), all_greedy=tensors.all_greedy,
                           top_k=rep(tensors.top_k), max_top_k=tensors.max_top_k, top_p=rep(tensors.top_p),
                           min_p=rep(tensors.min_p))


SETTINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.35),
    SamplingParams(top_k=3, top_p=0.75),  # top_p over the top-3 renormalised: keeps 2 (over all: 3)
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.3, min_p=0.1, top_k=6, top_p=0.9),
    SamplingParams(temperature=0.5, top_k=2),
]


@pytest.mark.parametrize("only_top_k", [False, True])
def test_empirical_frequencies_match_the_filtered_distribution(only_top_k):
    """Rows with different settings in one batch; exact zero mass outside the kept set, chi-square inside it."""
    settings = [p for p in SETTINGS if p.top_p == 1.0] if only_top_k else SETTINGS  # the topk() path, no sort
    tensors = build_sampling_tensors([seq_with(p) for p in settings], len(PROBS), CPU)
    assert (tensors.top_p is None) == only_top_k
    draws = 40_000
    batch = len(settings)
    logits = LOGITS.repeat(batch * draws, 1)
    tokens = Sampler()(logits, tile(tensors, draws), torch.Generator().manual_seed(0)).token_ids
    tokens = tokens.view(draws, batch)
    for row, p in enumerate(settings):
        expected = reference_distribution(LOGITS, p)
        counts = np.bincount(tokens[:, row].numpy(), minlength=len(PROBS))
        assert (counts[expected == 0] == 0).all(), f"{p}: sampled a token the filter removes: {counts}"
        kept = expected > 0
        if kept.sum() == 1:
            continue
        chi2 = (((counts[kept] - draws * expected[kept]) ** 2) / (draws * expected[kept])).sum()
        assert chi2 < CHI2_LIMIT[int(kept.sum()) - 1], f"{p}: chi2 {chi2:.1f}, counts {counts}, expected {expected}"


def test_chi_square_detects_a_wrong_distribution():
    # the check above can fail: plain temperature-1 draws do not fit the temperature-0.7 distribution
    tensors = build_sampling_tensors([seq_with(SamplingParams())], len(PROBS), CPU)
    draws = 40_000
    tokens = Sampler()(LOGITS.repeat(draws, 1), tile(tensors, draws), torch.Generator().manual_seed(0)).token_ids
    counts = np.bincount(tokens.numpy(), minlength=len(PROBS))
    expected = reference_distribution(LOGITS, SamplingParams(temperature=0.7))
    chi2 = (((counts - draws * expected) ** 2) / (draws * expected)).sum()
    assert chi2 > 10 * CHI2_LIMIT[7]


def test_top_k_1_and_tiny_top_p_are_greedy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=g) * 3
    greedy = logits.argmax(dim=-1)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-9), SamplingParams(temperature=2.0, top_k=1)):
        tensors = build_sampling_tensors([seq_with(params) for _ in range(64)], 1000, CPU)
        out = Sampler()(logits, tensors, g).token_ids
        assert torch.equal(out, greedy), params


def test_ties_at_the_top_resolve_like_argmax():
    # bf16 logits tie often; top_k=1 and a tiny top_p must still pick argmax's token (the lowest id)
    logits = torch.zeros(3, 300)
    logits[:, [17, 120, 250]] = 4.0
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_p=1e-6, top_k=2)):
        tensors = build_sampling_tensors([seq_with(params) for _ in range(3)], 300, CPU)
        for seed in range(5):
            out = Sampler()(logits, tensors, torch.Generator().manual_seed(seed)).token_ids
            assert out.tolist() == [17, 17, 17], params


def test_logits_are_not_modified_in_place():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [SamplingParams(top_k=5, top_p=0.5, min_p=0.1, repetition_penalty=1.5, presence_penalty=1.0,
                             frequency_penalty=1.0, min_tokens=3, logprobs=2) for _ in range(4)]
    seqs = [seq_with(p, prompt=[1, 2, 3], output=[4, 4]) for p in params]
    for s in seqs:
        s.extras.min_tokens_stop_ids = (7,)
    Sampler()(logits, build_sampling_tensors(seqs, 50, CPU), torch.Generator().manual_seed(0))
    assert torch.equal(logits, before)


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """vLLM's definitions, token by token: repetition over prompt + output, then frequency and presence over output."""
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_penalties_equal_a_direct_reference():
    rng = np.random.default_rng(0)
    vocab = 40
    params = [SamplingParams(temperature=0, repetition_penalty=1.7),
              SamplingParams(temperature=0),  # no penalty: passes through untouched
              SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.7),
              SamplingParams(temperature=0, presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.6),
              SamplingParams(temperature=0, frequency_penalty=2.0, repetition_penalty=1.3)]
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in (5, 3, 8, 6, 1)]
    outputs = [rng.integers(0, vocab, size=n).tolist() for n in (7, 2, 9, 0, 12)]
    seqs = [seq_with(p, prompt, output) for p, prompt, output in zip(params, prompts, outputs, strict=True)]
    logits = torch.tensor(rng.normal(size=(5, vocab)) * 2, dtype=torch.float32)
    expected = torch.tensor([reference_penalties(logits[i].tolist(), prompts[i], outputs[i], params[i])
                             for i in range(5)], dtype=torch.float32)
    tensors = build_sampling_tensors(seqs, vocab, CPU)
    assert tensors.penalty_rows.tolist() == [0, 2, 3, 4]
    rows = tensors.penalty_rows
    got = apply_penalties(logits[rows], tensors.output_counts, tensors.prompt_mask, tensors.presence_penalties,
                          tensors.frequency_penalties, tensors.repetition_penalties)
    torch.testing.assert_close(got, expected[rows])
    # and through the sampler: greedy over the penalised logits
    tokens = Sampler()(logits, tensors).token_ids
    assert tokens.tolist() == expected.argmax(dim=-1).tolist()
    assert tokens[1] == logits[1].argmax()


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[:, 4] = 10.0  # token 4 (say, EOS) is by far the most likely
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6])
    seqs = [seq_with(params, output=out) for out in ([], [1], [1, 1])]
    for s in seqs:
        s.extras.min_tokens_stop_ids = (4, 6)
    logits[:, 6] = 9.0
    tokens = Sampler()(logits, build_sampling_tensors(seqs, vocab, CPU)).token_ids.tolist()
    assert tokens[0] not in (4, 6) and tokens[1] not in (4, 6)
    assert tokens[2] == 4, "once min_tokens tokens exist, EOS is allowed again"


def test_logprobs_are_log_softmax_of_the_raw_logits():
    g = torch.Generator().manual_seed(3)
    vocab = 100
    logits = torch.randn(4, vocab, generator=g) * 2
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=5, repetition_penalty=2.0),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=0, logprobs=2, min_tokens=1)]
    seqs = [seq_with(p, prompt=[1, 2], output=[]) for p in params]
    seqs[3].extras.min_tokens_stop_ids = (int(logits[3].argmax()),)  # the raw argmax is masked: sampled rank is 2
    tensors = build_sampling_tensors(seqs, vocab, CPU)
    out = Sampler()(logits, tensors, g)
    reference = torch.log_softmax(logits.double(), dim=-1)
    lp = out.logprobs
    rows = [0, 2, 3]
    assert tensors.logprob_rows.tolist() == rows and tensors.num_logprobs == 5
    for j, row in enumerate(rows):
        token = int(out.token_ids[row])
        assert abs(lp.sampled[j].item() - reference[row, token].item()) < 1e-5
        assert lp.ranks[j].item() == int((reference[row] > reference[row, token]).sum()) + 1
        top = reference[row].topk(5)
        assert lp.top_ids[j].tolist() == top.indices.tolist()
        torch.testing.assert_close(lp.top_logprobs[j].double(), top.values, atol=1e-5, rtol=0)
    assert lp.ranks[2].item() == 2


def test_a_seeded_row_draws_the_same_tokens_in_any_batch():
    vocab = 500
    g = torch.Generator().manual_seed(4)
    row = torch.randn(vocab, generator=g)

    def draw(seed, batch_params, position, steps=5):
        seqs = [seq_with(p) for p in batch_params]
        seqs.insert(position, seq_with(SamplingParams(temperature=1.0, seed=seed)))
        tokens = []
        for _ in range(steps):
            logits = torch.randn(len(seqs), vocab, generator=g)
            logits[position] = row
            out = Sampler()(logits, build_sampling_tensors(seqs, vocab, CPU), g).token_ids
            tokens.append(int(out[position]))
            for s, t in zip(seqs, out.tolist(), strict=True):
                s.append_token(t)
        return tokens

    alone = draw(1234, [], 0)
    assert len(set(alone)) > 1, "the draws vary from step to step"
    mixed = draw(1234, [SamplingParams(top_p=0.5), SamplingParams(temperature=0), SamplingParams(seed=7),
                        SamplingParams(presence_penalty=1.0)], 2)
    assert mixed == alone
    assert draw(1235, [], 0) != alone, "another seed, other tokens"


@pytest.mark.parametrize("draw, expected", [(0.0, [1, 0]), (0.4, [1, 2]), (float(np.nextafter(np.float32(1), 0)), [2, 2]),
                                            (1.0, [2, 2])])
def test_inverse_cdf_never_picks_a_zero_probability_token(monkeypatch, draw, expected):
    """At the edges of the uniform draw (0, just below 1, and 1 itself, which rounding of draw x total can reach)
    the token found is one with probability above 0, never a filtered one before, between or after."""
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.0, 0.75, 0.0]])
    monkeypatch.setattr(sampler_module.torch, "rand", lambda shape, **kw: torch.full(
        shape if isinstance(shape, tuple) else (shape,), draw))
    assert inverse_cdf_sample(probs, None, {}).tolist() == expected


def test_temperature_tensor_still_accepted():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    out = Sampler()(logits, torch.tensor([0.0, 0.0, 0.0])).token_ids
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_token_counts_follow_new_tokens_across_steps():
    # the per-sequence token cache must pick up tokens appended after an earlier step
    params = SamplingParams(temperature=0, frequency_penalty=1.0, repetition_penalty=2.0)
    seq = seq_with(params, prompt=[1, 2], output=[3])
    for step in range(40):
        tensors = build_sampling_tensors([seq], 50, CPU)
        expected = np.bincount(seq.completion_token_ids, minlength=50)
        assert tensors.output_counts[0].tolist() == expected.tolist(), step
        assert tensors.prompt_mask[0].nonzero().flatten().tolist() == [1, 2]
        seq.append_token((step * 7) % 50)


def test_temperature_only_rows_draw_the_seeds_build_sampling_tensors_draws():
    """Tensor-parallel slice sampling gets the temperatures and seeds the one-device path would use, and declines
    a step with anything else to do (top-k, top-p, min-p, penalties, min_tokens, logprobs)."""
    from nanovllm.engine.sampling import temperature_only_rows

    def batch():  # fresh sequences each time: a seeded request keeps its own seed generator
        return [seq_with(SamplingParams(temperature=0.0)), seq_with(SamplingParams(temperature=0.7)),
                seq_with(SamplingParams(temperature=1.0, seed=9)), seq_with(SamplingParams(temperature=0.5, top_k=1))]
    temperatures, seeds = temperature_only_rows(batch(), np.random.default_rng(4))
    tensors = build_sampling_tensors(batch(), 50, CPU, np.random.default_rng(4))
    assert temperatures.tolist() == pytest.approx([0.0, 0.7, 1.0, 0.0])  # top_k=1 is greedy
    assert seeds.tolist() == tensors.row_seeds.tolist()

    source = np.random.default_rng(4)
    temperatures, seeds = temperature_only_rows([seq_with(SamplingParams(temperature=0))] * 3, source)
    assert not temperatures.any() and not seeds.any()
    assert source.integers(0, 1 << 62) == np.random.default_rng(4).integers(0, 1 << 62), "all greedy: no draw"

    for params in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(presence_penalty=0.5),
                   dict(repetition_penalty=1.2), dict(logprobs=2), dict(min_tokens=3)):
        step = [seq_with(SamplingParams(temperature=0.8)), seq_with(SamplingParams(temperature=0.8, **params))]
        assert temperature_only_rows(step, np.random.default_rng(0)) is None, params
    assert temperature_only_rows([seq_with(SamplingParams(temperature=0.8, min_tokens=1), output=(3,))],
                                 np.random.default_rng(0)) is not None, "min_tokens already reached"
