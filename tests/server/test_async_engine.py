"""AsyncLLM in process: concurrent requests match offline generation; aborts free blocks; errors stay local."""

from __future__ import annotations

import asyncio

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_engine import AsyncLLM, EngineDeadError, IterationStats, QueueFullError
from nanovllm.sampling_params import RequestOutputKind
from tests.server.conftest import wait_idle


@pytest.fixture
def llm(chat_model):
    stats: list[IterationStats] = []
    async_llm = AsyncLLM(LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=128, max_num_seqs=4),
                         max_queued_requests=2, stats_listeners=[stats.append])
    async_llm.stats = stats
    yield async_llm
    async_llm.shutdown()


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str):
    outputs = [o async for o in llm.generate(prompt, params, request_id)]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    return outputs


def test_concurrent_requests_match_offline(llm, chat_model):
    prompts = ["Hello, world!", "Paged attention keeps", "Once upon a time", "The quick brown", "Continuous",
               "How are you today?"]  # more than max_num_seqs: some wait for a slot
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(llm, p, params, f"r{i}") for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    offline = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=128)
    expected = offline.generate(prompts, params, use_tqdm=False)
    offline.close()
    for outputs, exp in zip(results, expected, strict=True):
        assert outputs[-1].outputs[0].token_ids == exp.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == exp.outputs[0].text
        # cumulative outputs: token lists only grow
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths)
    assert llm.engine.scheduler.block_manager.usage == 0
    finished = [f for s in llm.stats for f in s.finished]
    assert sorted(f.finish_reason for f in finished) == ["length"] * len(prompts)
    assert all(f.num_generation_tokens == 10 and f.time_per_output_token > 0 for f in finished)
    assert sum(s.num_generation_tokens for s in llm.stats) == 10 * len(prompts)
    assert len([t for s in llm.stats for t in s.time_to_first_token]) == len(prompts)


def test_leaving_a_stream_aborts_the_request_and_frees_its_blocks(llm):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def main():
        stream = llm.add_request("Talk forever.", params, "long")
        first = await stream.__anext__()
        assert not first.finished
        assert llm.engine.scheduler.block_manager.usage > 0
        stream.close()
        # cancelling a waiting consumer aborts too (once its request runs: a fast machine finishes a tiny model's
        # 500 tokens within a fixed wait)
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate("Talk forever, again.", params, "long2"):
                started.set()

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_idle(llm, tries=200)
    assert llm.engine.scheduler.block_manager.usage == 0
    assert llm.engine.requests == {}
    aborted = [f for s in llm.stats for f in s.finished if f.finish_reason == "abort"]
    assert len(aborted) == 2 and all(f.num_generation_tokens < 500 for f in aborted)
    assert llm.stats[-1].num_running == 0 and llm.stats[-1].kv_cache_usage == 0


def test_a_bad_request_fails_alone(llm):
    async def main():
        good = asyncio.ensure_future(collect(llm, "Hello", SamplingParams(temperature=0, max_tokens=3), "good"))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(llm, [1, 2, 10**6], SamplingParams(max_tokens=3), "bad")
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(collect(llm, "a", SamplingParams(max_tokens=50), "same"),
                                 collect(llm, "b", SamplingParams(max_tokens=50), "same"))
        return await good

    assert asyncio.run(main())[-1].outputs[0].finish_reason == "length"
    wait_idle(llm, tries=200)
    assert llm.num_in_flight == 0


def test_queue_limit(llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        # max_num_seqs 4 + max_queued_requests 2 in flight at most
        streams = [llm.add_request("Hi", params, f"q{i}") for i in range(6)]
        with pytest.raises(QueueFullError):
            llm.add_request("Hi", params, "q6")
        for s in streams:
            s.close()

    asyncio.run(main())
    wait_idle(llm, tries=200)
    assert llm.num_in_flight == 0


def test_shutdown_ends_streams_and_refuses_new_requests(llm):
    async def main():
        stream = llm.add_request("Talk forever.", SamplingParams(max_tokens=500, ignore_eos=True), "s")
        await stream.__anext__()
        await asyncio.to_thread(llm.shutdown)
        last = [o async for o in stream][-1]
        assert last.finished and last.outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            llm.add_request("Hi", SamplingParams(), "late")

    asyncio.run(main())
    assert not llm.is_running


def test_an_engine_failure_fails_requests_and_the_health_check(llm):
    from fastapi.testclient import TestClient

    from nanovllm.server.app import build_app

    def broken_step():
        raise RuntimeError("kernel exploded")

    llm.engine.step = broken_step
    with TestClient(build_app(llm, served_model_names=["tiny"])) as client:
        assert client.get("/health").status_code == 200
        response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 503
        assert "kernel exploded" in response.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        again = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert again.status_code == 503 and set(again.json()["error"]) == {"message", "type", "param", "code"}
    assert not llm.is_running and isinstance(llm.error, RuntimeError)


def test_a_step_wakes_each_event_loop_once(llm):
    """A step's outputs reach the caller's loop in one hand-over, not one per request (each hand-over writes to
    the loop's wake-up pipe and takes the GIL from the engine thread)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello, world!", "Paged attention keeps", "Once upon a time", "The quick brown"]  # max_num_seqs

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args, **kwargs: calls.append(args[0]) or original(*args, **kwargs)
        results = await asyncio.gather(*(collect(llm, p, params, f"w{i}") for i, p in enumerate(prompts)))
        return calls, results

    calls, results = asyncio.run(main())
    assert all(sum(len(c.token_ids) for c in r[-1].outputs) == 8 for r in results)
    # 4 requests x 8 tokens would be 32 hand-overs one per request; the batch runs ~9 steps (prefill + 7 decodes)
    assert len(calls) <= 12, f"{len(calls)} hand-overs for 4 requests of 8 tokens"


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_output_kinds_add_up_to_the_cumulative_output(llm, kind):
    """DELTA outputs hold only what is new (joined: the cumulative output); FINAL_ONLY gives one, finished."""
    base = dict(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, n=2, logprobs=1, stop=["ow"])

    async def main():
        cumulative = await collect(llm, "Hello, world!", SamplingParams(**base), "c")
        other = await collect(llm, "Hello, world!", SamplingParams(**base, output_kind=kind), "k")
        return cumulative, other

    cumulative, other = asyncio.run(main())
    final = cumulative[-1]
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(other) == 1 and other[0].outputs == final.outputs
        return
    assert len(other) >= 2  # (a consumer that falls behind gets several steps folded into one)
    joined = other[0]
    for later in other[1:]:  # cumulative outputs joined would repeat their tokens and text
        joined.add(later)
    assert joined.outputs == final.outputs and joined.finished
