"""Speculative decoding behind AsyncLLM: streams take several tokens a step, the text and tokens equal plain
decoding's, and the speculation counters reach the Prometheus metrics."""

from __future__ import annotations

import asyncio

from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_engine import AsyncLLM, IterationStats
from nanovllm.server.metrics import ServerMetrics

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["one two three four one two three four one two", "the cat sat on the mat, the cat sat on"]


def test_streams_match_plain_decoding_and_report_speculation(chat_model):
    stats: list[IterationStats] = []
    engine = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=128, speculative_config=SPEC)
    async_llm = AsyncLLM(engine, stats_listeners=[stats.append])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["zzz-never"])

    async def collect(prompt, request_id):
        return [o async for o in async_llm.generate(prompt, params, request_id)]

    async def main():
        return await asyncio.gather(*(collect(p, f"r{i}") for i, p in enumerate(PROMPTS)))

    try:
        streams = asyncio.run(main())
    finally:
        async_llm.shutdown()
    plain = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=128)
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    plain.close()
    growth = []
    for outputs, exp in zip(streams, expected, strict=True):
        assert outputs[-1].outputs[0].token_ids == exp.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == exp.outputs[0].text
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        growth += [b - a for a, b in zip(lengths, lengths[1:])]
    assert max(growth) > 1, "some step delivered several tokens"
    drafts = sum(s.spec_num_drafts for s in stats)
    accepted = sum(s.spec_num_accepted_tokens for s in stats)
    assert drafts == engine.scheduler.spec_stats.num_drafts > 0 and accepted > 0
    assert sum(sum(s.spec_accepted_per_position) for s in stats) == accepted

    metrics = ServerMetrics("tiny")
    for s in stats:
        metrics.record(s)
    text = metrics.render().decode()
    assert f'nanovllm:spec_decode_num_drafts_total{{model_name="tiny"}} {float(drafts)}' in text
    assert f'nanovllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(accepted)}' in text
    assert 'nanovllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
    mean = 1 + accepted / drafts
    assert f'nanovllm:spec_decode_mean_acceptance_length{{model_name="tiny"}} {mean}' in text


def test_stop_strings_end_a_verify_step_at_the_token_that_completes_them(chat_model):
    plain = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=128)
    spec = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=128, speculative_config=SPEC)
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    full = [o.outputs[0] for o in plain.generate(PROMPTS, base, use_tqdm=False)]
    checked = 0
    for prompt, out in zip(PROMPTS, full, strict=True):
        text = out.text
        for include, at in ((False, len(text) // 3), (True, 2 * len(text) // 3)):
            stop = text[at:at + 3]
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1, stop=[stop],
                                    include_stop_str_in_output=include)
            ours = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            theirs = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert (ours.text, ours.token_ids, ours.finish_reason, ours.stop_reason) == \
                   (theirs.text, theirs.token_ids, theirs.finish_reason, theirs.stop_reason)
            assert len(ours.logprobs) == len(ours.token_ids)
            checked += theirs.finish_reason == "stop"
    assert checked >= 3
    assert spec.scheduler.spec_stats.num_accepted_tokens > 0
    spec.scheduler.block_manager.check_invariants()
    assert spec.scheduler.block_manager.num_free_blocks == spec.scheduler.block_manager.num_blocks
