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
