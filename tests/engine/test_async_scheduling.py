"""Asynchronous scheduling (step n+1 planned and launched before step n's tokens are read) changes nothing a
user sees: same greedy tokens, stop conditions, logprobs and aborts as the synchronous engine, every block freed.

It is on by default only with CUDA; the CPU runs the same code path when asked, which is how it is tested here.
"""

import pytest
import torch

from nanovllm import LLM, SamplingParams

BLOCK = 16


def prompts(count: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, BLOCK - 1, BLOCK, BLOCK + 1, 40, 63, 100][:count]
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in lengths]


def engines(model, **kwargs):
    base = dict(kvcache_block_size=BLOCK, num_kvcache_blocks=128, **kwargs)
    return LLM(model, async_scheduling=False, **base), LLM(model, async_scheduling=True, **base)


def spy_ahead(llm) -> list[int]:
    """Counts the steps launched ahead (sizes of the planned batches)."""
    sizes = []
    original = llm.scheduler.schedule_ahead

    def spy(in_flight):
        seqs = original(in_flight)
        if seqs:
            sizes.append(len(seqs))
        return seqs

    llm.scheduler.schedule_ahead = spy
    return sizes


def assert_all_free(llm) -> None:
    bm = llm.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    in_flight = llm.llm_engine._in_flight
    assert in_flight is None or all(s.is_finished for s in in_flight.seqs)


def test_same_greedy_tokens_with_varied_lengths_and_eos(tiny_qwen3):
    sync, ahead = engines(tiny_qwen3)
    launched = spy_ahead(ahead)
    # varied max_tokens: requests leave the batch at different steps; EOS (id 2) may stop some early
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (1, 2, 7, 16, 33, 5, 20, 9)]
    expected = sync.generate(prompts(8), params, use_tqdm=False)
    got = ahead.generate(prompts(8), params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert [len(o.token_ids) for o in got] == [1, 2, 7, 16, 33, 5, 20, 9] or any(
        o.finish_reason == "stop" for o in got)
    assert len(launched) >= 20, "most decode steps were launched ahead"
    assert_all_free(ahead)
    # and again on the same engine: nothing left over from the first batch
    again = ahead.generate(prompts(8), params, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    assert_all_free(ahead)


def test_stop_token_ids_and_stop_reasons(tiny_qwen3):
    sync, ahead = engines(tiny_qwen3)
    probe = sync.generate(prompts(4), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)
    # stop on the token each request produces 5th: the planned step after it must be dropped
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[o.token_ids[4]])
              for o in probe]
    expected = sync.generate(prompts(4), params, use_tqdm=False)
    got = ahead.generate(prompts(4), params, use_tqdm=False)
    assert [(o.token_ids, o.finish_reason, o.outputs[0].stop_reason) for o in got] == \
        [(o.token_ids, o.finish_reason, o.outputs[0].stop_reason) for o in expected]
    assert all(o.finish_reason == "stop" and len(o.token_ids) <= 5 for o in got)
    assert_all_free(ahead)


def test_logprobs_and_seeded_sampling_match(tiny_qwen3):
    sync, ahead = engines(tiny_qwen3)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
    expected = sync.generate(prompts(5), params, use_tqdm=False)
    got = ahead.generate(prompts(5), params, use_tqdm=False)
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert [list(d) for d in a.outputs[0].logprobs] == [list(d) for d in b.outputs[0].logprobs]
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)


def test_penalties_and_min_tokens_fall_back_to_sync_and_match(tiny_qwen3):
    sync, ahead = engines(tiny_qwen3)
    launched = spy_ahead(ahead)
    params = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, min_tokens=3)
    expected = sync.generate(prompts(3), params, use_tqdm=False)
    got = ahead.generate(prompts(3), params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert launched == [], "sampling that reads a request's own history is never planned ahead"


def test_abort_while_a_step_is_in_flight(tiny_qwen3):
    _, ahead = engines(tiny_qwen3)
    engine = ahead
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts(4)]
    for _ in range(4):
        engine.step()
    assert engine.llm_engine._in_flight is not None, "a step is planned ahead"
    assert engine.abort_request(ids[1])
    finished = {}
    while engine.has_unfinished_requests():
        for seq in engine.step():
            assert seq.extras.request_id != ids[1], "an aborted request gets no more tokens"
            if engine.is_request_finished(seq.extras.request_id):
                finished[seq.extras.request_id] = engine.pop_finished(seq.extras.request_id)
    assert sorted(finished) == sorted(set(ids) - {ids[1]})
    assert all(len(o.outputs[0].token_ids) == 30 for o in finished.values())
    assert_all_free(ahead)


def test_new_requests_join_between_planned_steps(tiny_qwen3):
    """A request added while a step is in flight waits for it, then joins the batch (synchronous steps)."""
    sync, ahead = engines(tiny_qwen3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = sync.generate(prompts(6), params, use_tqdm=False)
    engine = ahead
    first = [engine.add_request(p, params) for p in prompts(6)[:3]]
    for _ in range(5):
        engine.step()
    later = [engine.add_request(p, params) for p in prompts(6)[3:]]
    outputs = {}
    while engine.has_unfinished_requests():
        for seq in engine.step():
            if engine.is_request_finished(seq.extras.request_id):
                outputs[seq.extras.request_id] = engine.pop_finished(seq.extras.request_id)
    assert [outputs[i].outputs[0].token_ids for i in first + later] == [o.token_ids for o in expected]
    assert_all_free(ahead)


def test_small_pool_stops_planning_ahead_instead_of_preempting(tiny_qwen3):
    """With too few free blocks for the next step, the engine steps synchronously and preempts as usual."""
    base = dict(kvcache_block_size=BLOCK, num_kvcache_blocks=12, max_model_len=200)
    sync = LLM(tiny_qwen3, async_scheduling=False, **base)
    ahead = LLM(tiny_qwen3, async_scheduling=True, **base)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = sync.generate(prompts(6), params, use_tqdm=False)
    got = ahead.generate(prompts(6), params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert ahead.scheduler.stats.num_preemptions > 0
    assert_all_free(ahead)

