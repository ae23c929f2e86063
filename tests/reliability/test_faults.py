"""Faults: an exception while processing one request fails that request alone; the engine and the others go on.

The fault is injected into the detokenizer of the requests whose prompt ends with a marker token (the detokenizer
keeps the prompt's last tokens as context, so it knows), where the engine processes each request's output: while
checking stop strings in a step, or while building an output. The poisoned request ends with finish_reason
"error" (offline) or a 500 / an error event (server), its KV blocks are freed at once, and every other request
gets exactly the tokens of a run without the fault.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine import detokenizer as detokenizer_module
from nanovllm.engine.async_engine import AsyncLLM, RequestFailedError
from tests.reliability.conftest import serve_in_thread
from tests.server.conftest import wait_idle

MARKER = 313  # a token id; prompts ending with it are poisoned
GOOD = [[40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54], [60, 61, 62, 63, 64, 65, 66], [70, 71, 72, 73, 74, 75]]
POISONED = [80, 81, 82, 83, MARKER]
TOKENS = 12


class InjectedFault(RuntimeError):
    pass


@pytest.fixture
def poison(monkeypatch):
    """Make the detokenizer raise for poisoned requests, from their first generated token on."""
    original = detokenizer_module.IncrementalDetokenizer.update
    calls = {"raised": 0}

    def update(self, token_ids):
        if MARKER in self.ids[:detokenizer_module.CONTEXT_TOKENS]:
            calls["raised"] += 1
            raise InjectedFault("the detokenizer broke on this request")
        return original(self, token_ids)

    monkeypatch.setattr(detokenizer_module.IncrementalDetokenizer, "update", update)
    return calls


@pytest.fixture(scope="module")
def llm(chat_model):
    engine = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8)
    yield engine
    engine.close()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, **kwargs)


def assert_empty(engine) -> None:
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "every KV block is free"
    assert not engine.has_unfinished_requests() and engine.requests == {}


@pytest.fixture(scope="module")
def clean_outputs(llm):
    """Outputs of the good prompts without any fault."""
    return [o.outputs[0] for o in llm.generate(GOOD, greedy(stop=["@@@"]), use_tqdm=False)]


@pytest.fixture(scope="module")
def clean(clean_outputs):
    return [o.token_ids for o in clean_outputs]


@pytest.mark.parametrize("stop", [["@@@"], None], ids=["fault-while-checking-stop-strings", "fault-in-make-output"])
def test_offline_fault_fails_only_its_request(llm, clean, poison, stop):
    outputs = llm.generate(GOOD[:2] + [POISONED] + GOOD[2:], greedy(stop=stop), use_tqdm=False)
    assert poison["raised"] >= 1
    bad = outputs.pop(2)
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    if stop:  # the fault came in a step: the request stopped there, after its first token, and freed its blocks
        assert len(bad.outputs[0].token_ids) == 1
    assert [o.outputs[0].token_ids for o in outputs] == clean
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_empty(llm)


def test_offline_fault_ends_every_sample_of_an_n_request(llm, clean, poison):
    outputs = llm.generate([GOOD[0], POISONED], greedy(stop=["@@@"], n=3, seed=1), use_tqdm=False)
    assert [c.finish_reason for c in outputs[1].outputs] == ["error"] * 3
    assert [c.finish_reason for c in outputs[0].outputs] == ["length"] * 3
    assert outputs[0].outputs[0].token_ids == clean[0]
    assert_empty(llm)


def test_fault_reported_by_the_engine(llm, poison):
    request_id = llm.add_request(POISONED, greedy(stop=["@@@"]))
    while not llm.is_request_finished(request_id):
        llm.step()
    assert "InjectedFault" in llm.request_error(request_id)
    assert llm.pop_finished(request_id).outputs[0].finish_reason == "error"
    assert_empty(llm)


# -- through the server ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(chat_model):
    """An in-process server (so the test can patch its engine) over a small pool."""
    from nanovllm.server.app import build_app

    async_llm = AsyncLLM(LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=32, max_num_seqs=8))
    with serve_in_thread(build_app(async_llm, served_model_names=["tiny"])) as url:
        yield url, async_llm


def assert_idle(async_llm: AsyncLLM) -> None:
    wait_idle(async_llm)
    assert async_llm.is_running and async_llm.num_in_flight == 0
    assert_empty(async_llm.engine)


def finished_metric(url: str, reason: str) -> float:
    from tests.server.conftest import metric_values
    return metric_values(url)[f'nanovllm:request_success_total{{finished_reason="{reason}"}}']


@pytest.mark.parametrize("stop", [["@@@"], None], ids=["fault-while-checking-stop-strings", "fault-in-make-output"])
def test_server_fault_fails_only_its_request(served, clean_outputs, poison, stop):
    url, async_llm = served
    errors_before = finished_metric(url, "error")

    async def one(client: httpx.AsyncClient, prompt: list[int], stream: bool):
        body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stop": stop,
                "logprobs": 0, "stream": stream}
        if not stream:
            return await client.post("/v1/completions", json=body)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            return response.status_code, [line async for line in response.aiter_lines() if line]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(one(client, p, False) for p in GOOD), one(client, POISONED, False),
                                        one(client, POISONED, True), *(one(client, p, True) for p in GOOD))

    results = asyncio.run(main())
    good, failed, failed_stream, streams = results[:4], results[4], results[5], results[6:]
    # the poisoned request: a 500 in OpenAI's shape, naming what failed
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["code"] == "request_failed" and "InjectedFault" in error["message"]
    # streamed: the response had begun, so the error comes as an event, then the end of the stream
    status, events = failed_stream
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_failed"
    # the others: their full answers, the same tokens as without the fault
    for response, expected in zip(good, clean_outputs, strict=True):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["text"] == expected.text and len(choice["logprobs"]["tokens"]) == len(expected.token_ids)
    for (status, events), expected in zip(streams, clean_outputs, strict=True):
        assert status == 200 and events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert httpx.get(url + "/health").status_code == 200
    assert finished_metric(url, "error") - errors_before == 2
    assert_idle(async_llm)


def test_an_uncontained_fault_still_fails_one_request(served, clean, monkeypatch):
    """A fault the engine did not contain (here: building any output of the poisoned request) is caught by the
    loop around the engine, which aborts that request alone."""
    _, async_llm = served
    engine = async_llm.engine
    original = engine.make_output

    def make_output(request_id):
        output = original(request_id)
        if output.prompt_token_ids[-1] == MARKER:
            raise InjectedFault("make_output broke on this request")
        return output

    monkeypatch.setattr(engine, "make_output", make_output)

    async def collect(prompt, request_id):
        return [o async for o in async_llm.generate(prompt, greedy(), request_id)][-1]

    async def main():
        return await asyncio.gather(*(collect(p, f"good-{i}") for i, p in enumerate(GOOD)),
                                    collect(POISONED, "bad"), return_exceptions=True)

    *good, bad = asyncio.run(main())
    assert isinstance(bad, RequestFailedError) and "InjectedFault" in str(bad)
    assert [o.outputs[0].token_ids for o in good] == clean
    assert_idle(async_llm)


def test_request_that_can_never_fit_the_pool_is_refused_at_admission(served):
    """The pool holds 32 blocks of 16 = 512 tokens, less than max_model_len (1024): a request that could grow
    beyond it is refused with a 400 naming the pool, instead of waiting forever for room that cannot come."""
    url, async_llm = served
    assert async_llm.engine.num_kvcache_blocks * 16 == 512 < async_llm.max_model_len
    for body in ({"prompt": [5] * 400, "max_tokens": 200}, {"messages": [{"role": "user", "content": "Hi"}]}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        response = httpx.post(url + path, json=body, timeout=10)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "pool holds 512" in error["message"] and error["param"] == "max_tokens"
    # what fits is served
    response = httpx.post(url + "/v1/completions", json={"prompt": [5] * 400, "max_tokens": 100}, timeout=30)
    assert response.status_code == 200
    assert_idle(async_llm)


# -- one slow or huge request does not stall the others ------------------------------------------------------------
def test_tokenizing_runs_off_the_event_loop(served, monkeypatch):
    """A prompt that takes long to tokenize (here 3 s, as a multi-megabyte one does) holds up no other request:
    tokenizers release the GIL, and the server tokenizes in a worker thread."""
    url, async_llm = served
    tokenizer = async_llm.engine.tokenizer
    original = tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if text.startswith("SLOW"):
            time.sleep(3.0)
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            slow = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "SLOW prompt",
                                                                             "max_tokens": 2}))
            await asyncio.sleep(0.3)  # the slow one is being tokenized now
            start = time.monotonic()
            health = await client.get("/health")
            fast = await client.post("/v1/completions", json={"prompt": "fast", "max_tokens": 2})
            took = time.monotonic() - start
            return (await slow).status_code, health.status_code, fast.status_code, took

    slow_status, health, fast, took = asyncio.run(main())
    assert (slow_status, health, fast) == (200, 200, 200)
    assert took < 1.5, f"other requests waited {took:.1f} s for a slow tokenization"


def test_text_too_long_to_fit_is_refused_before_tokenizing(served, monkeypatch):
    url, async_llm = served
    tokenizer = async_llm.engine.tokenizer
    calls = []
    original = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: calls.append(len(text)) or original(text, *a, **k))
    longest = max(len(t) for t in tokenizer.get_vocab())
    too_long = "x" * (longest * async_llm.max_model_len + 1)
    for path, body in [("/v1/completions", {"prompt": too_long}), ("/tokenize", {"prompt": too_long}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]})]:
        response = httpx.post(url + path, json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert str(async_llm.max_model_len) in response.json()["error"]["message"]
    assert calls == [], "text that cannot fit was tokenized"
    # one character less than the bound is tokenized (and then refused for its token count, or served)
    response = httpx.post(url + "/tokenize", json={"prompt": too_long[:-1]}, timeout=30)
    assert response.status_code == 200 and calls == [len(too_long) - 1]
