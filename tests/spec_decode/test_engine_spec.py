"""Speculative decoding gives the tokens of plain decoding (greedy) on a tiny random Qwen3, in every engine mode."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams

BLOCK = 16
NEW_TOKENS = 40
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    passages = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (12, 30, 50, 90)]
    # a passage, then its start again: the n-gram proposer finds what follows and the model may copy it
    prompts = [p + p[:len(p) // 2] for p in passages]
    prompts.append(torch.randint(3, 380, (20,), generator=g).tolist())  # nothing to copy
    prompts.append(prompts[3][:70] + [5, 6, 7])  # shares a prefix with another prompt
    return prompts


PROMPTS = make_prompts()


def generate(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "every KV block is free once all requests finished"
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=BLOCK, num_kvcache_blocks=256)
    return {"batched": generate(llm), "alone": [generate(llm, [p])[0] for p in PROMPTS]}


def spec_llm(tiny_qwen3, **kwargs) -> LLM:
    kwargs.setdefault("num_kvcache_blocks", 256)
    return LLM(tiny_qwen3, kvcache_block_size=BLOCK, speculative_config=SPEC, **kwargs)


def check_speculated(llm: LLM) -> None:
    stats = llm.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "some drafts were rejected (rolled back)"


def test_greedy_alone_and_batched_equal_plain_decoding(tiny_qwen3, plain):
    llm = spec_llm(tiny_qwen3, enable_prefix_caching=False)
    assert [generate(llm, [p])[0] for p in PROMPTS] == plain["alone"]
    check_speculated(llm)
    assert generate(llm) == plain["batched"]
    assert llm.scheduler.spec_stats.mean_acceptance_length > 1.0


def test_greedy_with_prefix_caching_equals_plain(tiny_qwen3, plain):
    llm = spec_llm(tiny_qwen3)
    assert generate(llm) == plain["batched"]
    assert generate(llm) == plain["batched"]  # now the prompts and verified outputs hit the cache
    check_speculated(llm)
    assert llm.scheduler.block_manager.num_hit_tokens > 0


def test_greedy_with_chunked_prefill_and_a_small_budget(tiny_qwen3, plain):
    steps = []
    llm = spec_llm(tiny_qwen3, max_num_batched_tokens=24, enable_prefix_caching=False)
    original = llm.scheduler.schedule

    def spy():
        seqs = original()
        assert sum(s.num_scheduled_tokens for s in seqs) <= 24
        steps.append(seqs)
        return seqs

    llm.scheduler.schedule = spy
    assert generate(llm) == plain["batched"]
    check_speculated(llm)


def test_greedy_with_preemption_equals_plain(tiny_qwen3, plain):
    # a pool far smaller than the batch needs: running requests give their blocks back and are recomputed
    llm = spec_llm(tiny_qwen3, num_kvcache_blocks=14)
    assert generate(llm) == plain["batched"]
    assert llm.scheduler.stats.num_preemptions > 0
    check_speculated(llm)


def test_length_limits_and_stop_tokens_hold_at_every_accepted_token(tiny_qwen3, plain):
    llm = spec_llm(tiny_qwen3)
    for max_tokens in (1, 2, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert generate(llm, params=params) == [t[:max_tokens] for t in plain["batched"]]
    # stop at a token the copy reaches in the middle of a verify step
    stops = [t[9] for t in plain["batched"]]
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[s]) for s in stops]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, full, stop in zip(outputs, plain["batched"], stops, strict=True):
        first = full.index(stop)
        assert out.outputs[0].token_ids == full[:first + 1] and out.outputs[0].finish_reason == "stop"
    # min_tokens: the stop token is masked until then, so tokens after min_tokens may differ; the first equal
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t[0]], min_tokens=5)
              for t in plain["batched"]]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, full in zip(outputs, plain["batched"], strict=True):
        tokens = out.outputs[0].token_ids
        assert len(tokens) >= 5 and full[0] not in tokens[1:5]


def test_logprobs_and_seeded_sampling(tiny_qwen3, plain):
    plain_llm = LLM(tiny_qwen3, kvcache_block_size=BLOCK, num_kvcache_blocks=256)
    llm = spec_llm(tiny_qwen3)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    ours = llm.generate(PROMPTS, params, use_tqdm=False)
    theirs = plain_llm.generate(PROMPTS, params, use_tqdm=False)
    check_speculated(llm)
    for a, b in zip(ours, theirs, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert list(la) == list(lb) and la[t].rank == lb[t].rank
            assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)
    # a seeded request's sample depends on its seed alone, also with speculation and n > 1
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=NEW_TOKENS, ignore_eos=True, seed=7, n=2,
                            repetition_penalty=1.1)
    first = [o.outputs for o in llm.generate(PROMPTS[:3], seeded, use_tqdm=False)]
    again = [o.outputs for o in llm.generate(PROMPTS[:3] + PROMPTS[3:], seeded, use_tqdm=False)[:3]]
    assert [[c.token_ids for c in o] for o in first] == [[c.token_ids for c in o] for o in again]
    llm.scheduler.block_manager.check_invariants()


def test_async_scheduling_plans_ahead_only_while_no_request_speculates(tiny_qwen3, plain):
    llm = spec_llm(tiny_qwen3, async_scheduling=True)
    ahead = []
    original = llm.scheduler.schedule_ahead

    def spy(in_flight):
        seqs = original(in_flight)
        assert not seqs or not any(s.draft_token_ids for s in in_flight)
        ahead.append(bool(seqs))
        return seqs

    llm.scheduler.schedule_ahead = spy
    assert generate(llm) == plain["batched"]
    check_speculated(llm)
    assert llm.llm_engine._in_flight is None or all(s.is_finished for s in llm.llm_engine._in_flight.seqs)
