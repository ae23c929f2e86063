"""Load against a deliberately small KV pool: nothing is lost, nothing leaks, and preemption changes no output.

One server process with a pool far smaller than the load needs (so requests are preempted and recomputed all the
time) and a short queue (so some requests get 429). Waves of requests with random lengths and parameters, some
invalid, some streamed, some abandoned by their client. Every request must complete, be abandoned by its client,
or fail with a reason (a 4xx in OpenAI's error shape); afterwards the server holds nothing (0 running, 0 waiting,
KV usage 0) and its memory is flat from one wave to the next.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

from tests.reliability.conftest import rss_bytes
from tests.server.conftest import ServerProcess, metric_values, wait_for

BLOCK = 16
NUM_BLOCKS = 48  # 768 tokens of KV cache for up to 16 running requests of up to ~200 tokens each
MAX_NUM_SEQS = 16
MAX_QUEUED = 10  # 26 in flight at most
MAX_N = 4
CONCURRENCY = 48
WAVE = 200
# each wave opens with this many long requests (128 tokens, EOS ignored) among its first 48, sent at once: they
# hold the small pool for seconds, so the in-flight limit is reached and some requests get 429 however fast the
# machine is (with short requests only, a fast machine answered them before 26 were ever in flight)
BURST = 32
BURST_TOKENS = 128
RETRY_AFTER = 1  # seconds, what the server's 429 says
REQUEST_TIMEOUT = 60.0  # no request may take longer: a hang fails the test instead of stalling it

RESULTS: dict[str, object] = {}  # what the waves did, for docs/reliability.md (printed with -s)


@pytest.fixture(scope="module")
def small_pool(chat_model):
    proc = ServerProcess(chat_model, "--kvcache-block-size", str(BLOCK), "--num-kvcache-blocks", str(NUM_BLOCKS),
                         "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED),
                         "--max-n", str(MAX_N), "--max-num-batched-tokens", "512")
    yield proc
    proc.stop()


def idle(url: str) -> dict | None:
    m = metric_values(url)
    if (m["nanovllm:num_requests_running"] == 0 and m["nanovllm:num_requests_waiting"] == 0
            and m["nanovllm:kv_cache_usage_perc"] == 0):
        return m
    return None


def finished_counts(m: dict) -> Counter:
    prefix = 'nanovllm:request_success_total{finished_reason="'
    return Counter({key[len(prefix):-2]: value for key, value in m.items() if key.startswith(prefix)})


# -- 1. preemption under a full pool changes no greedy output ----------------------------------------------------
PRESSURE_PROMPTS = [f"Request {i}: the quick brown fox number {i} jumps over {i % 7} lazy dogs." for i in range(24)]
PRESSURE_TOKENS = 24


def test_pool_exhaustion_preempts_and_outputs_equal_an_unpressured_run(small_pool, chat_model):
    """24 greedy requests that need ~72 blocks at their end, in a pool of 48: the newest are preempted and
    recomputed, and every text equals the offline engine's with a pool large enough for all of them."""
    from nanovllm import LLM, SamplingParams

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        response = await client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": PRESSURE_TOKENS, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        return choice["text"]

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=small_pool.url, timeout=REQUEST_TIMEOUT) as client:
            return await asyncio.gather(*(one(client, p) for p in PRESSURE_PROMPTS))

    before = metric_values(small_pool.url)["nanovllm:num_preemptions_total"]
    texts = asyncio.run(run_all())
    preemptions = metric_values(small_pool.url)["nanovllm:num_preemptions_total"] - before
    assert preemptions > 0, "the pool was meant to run dry"

    llm = LLM(chat_model, kvcache_block_size=BLOCK, num_kvcache_blocks=512)
    try:
        expected = llm.generate(PRESSURE_PROMPTS, SamplingParams(temperature=0, max_tokens=PRESSURE_TOKENS,
                                                                 ignore_eos=True), use_tqdm=False)
        assert llm.scheduler.stats.num_preemptions == 0
    finally:
        llm.close()
    assert texts == [e.outputs[0].text for e in expected]
    assert wait_for(lambda: idle(small_pool.url), timeout=10)
    RESULTS["pressure"] = {"requests": len(PRESSURE_PROMPTS), "preemptions": int(preemptions)}


# -- 2. the soak --------------------------------------------------------------------------------------------------
WORDS = ("the quick brown fox jumps over lazy dog hello world paged attention keeps keys and values in blocks "
         "continuous batching lets new requests join once upon a time small model answered every question").split()
# bodies a client may get wrong: each must be refused with this status, and never run
INVALID = [
    ({"prompt": "Hi", "temperature": -1}, 400),
    ({"prompt": "Hi", "max_tokens": 0}, 400),
    ({"prompt": "Hi", "n": 0}, 400),
    ({"prompt": "Hi", "n": MAX_N + 1}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": "Hi", "no_such_field": True}, 400),
    ({"prompt": "Hi", "model": "some/other/model"}, 404),
    ({"prompt": [5] * 1100}, 400),  # beyond max_model_len (1024)
    ({"prompt": "Hi", "top_p": float("nan")}, 400),
    ({"prompt": [1, 2, 99999]}, 400),
    ({"prompt": "Hi", "max_tokens": 200, "n": 4, "stop": ""}, 400),
    (b'{"prompt": "\xff\xfe caf\xe9"}', 400),  # not UTF-8
]
INVALID_EVERY = 12  # every 12th request of a wave is invalid, cycling through INVALID


@dataclass
class Plan:
    path: str
    body: dict | bytes
    stream: bool
    abandon: bool = False  # the client leaves early (mid-stream, or before a whole answer comes)
    expect: int = 200  # 200: valid (429 allowed); else the 4xx it must get


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


def plan_request(rng: random.Random, i: int) -> Plan:
    if i % INVALID_EVERY == 0:
        body, status = INVALID[(i // INVALID_EVERY) % len(INVALID)]
        if isinstance(body, bytes):
            return Plan("/v1/completions", body, False, expect=status)
        stream = rng.random() < 0.5
        return Plan("/v1/completions", body | ({"stream": True} if stream else {}), stream, expect=status)
    chat = rng.random() < 0.3
    if rng.random() < 0.5:
        prompt: str | list[int] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    else:
        prompt = [rng.randrange(5, 384) for _ in range(rng.randint(1, 200))]
    params: dict = {"max_tokens": rng.randint(1, 16), "temperature": rng.choice([0, 0.7, 1.0])}
    if rng.random() < 0.3:
        params["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.3:
        params["top_k"] = rng.choice([1, 5, 50])
    if rng.random() < 0.15:
        params["n"] = rng.randint(2, MAX_N)
    if rng.random() < 0.2:
        params["stop"] = [rng.choice(WORDS)[:3]]
    if rng.random() < 0.3:
        params["ignore_eos"] = True
    if rng.random() < 0.2:
        params["seed"] = rng.randint(0, 1 << 30)
    if rng.random() < 0.1:
        params["presence_penalty"] = 0.5
    if i < BURST:
        params.update(max_tokens=BURST_TOKENS, ignore_eos=True)
    if chat:
        text = prompt if isinstance(prompt, str) else "tokens " + " ".join(map(str, prompt[:30]))
        body = {"messages": [{"role": "user", "content": text}], **params}
        if rng.random() < 0.1:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        path = "/v1/chat/completions"
    else:
        body = {"prompt": prompt, **params}
        if rng.random() < 0.1:
            body["logprobs"] = rng.randint(0, 3)
        path = "/v1/completions"
    stream = rng.random() < 0.45
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return Plan(path, body | ({"stream": True} if stream else {}), stream, abandon=rng.random() < 0.12)


def check_error(response_status: int, text: str, headers, plan: Plan, tally: Tally) -> None:
    try:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"]
    except Exception:
        tally.failures.append(f"{response_status} without an OpenAI error body: {text[:200]}")
        return
    if response_status == 429:
        if int(headers.get("retry-after", "0")) != RETRY_AFTER:
            tally.failures.append(f"429 without Retry-After: {RETRY_AFTER}")
        tally.outcomes["rejected: queue full (429)"] += 1
    elif plan.expect != 200 and response_status == plan.expect:
        tally.outcomes[f"refused as invalid ({response_status})"] += 1
    else:
        tally.failures.append(f"{response_status} for {plan.body!r:.200}: {text[:200]}")


async def run_one(client: httpx.AsyncClient, plan: Plan, rng: random.Random, tally: Tally) -> None:
    """One request; a 429 is retried once after its Retry-After, as a well-behaved client does."""
    retry = Tally()
    await run_once(client, plan, rng, retry)
    if retry.outcomes["rejected: queue full (429)"]:
        await asyncio.sleep(RETRY_AFTER)
        retry = Tally()
        await run_once(client, plan, rng, retry)
    tally.outcomes.update(retry.outcomes)
    tally.failures.extend(retry.failures)


async def run_once(client: httpx.AsyncClient, plan: Plan, rng: random.Random, tally: Tally) -> None:
    content = plan.body if isinstance(plan.body, bytes) else json.dumps(plan.body).encode()
    headers = {"Content-Type": "application/json"}
    n = 1 if isinstance(plan.body, bytes) else plan.body.get("n", 1)
    try:
        if not plan.stream:
            # an abandoning client leaves before the whole answer can come: the server must abort the request
            timeout = rng.uniform(0.02, 0.3) if plan.abandon else REQUEST_TIMEOUT
            try:
                response = await client.post(plan.path, content=content, headers=headers, timeout=timeout)
            except httpx.TimeoutException:
                if not plan.abandon:
                    raise
                tally.outcomes["abandoned by its client"] += 1
                return
            if response.status_code != 200:
                check_error(response.status_code, response.text, response.headers, plan, tally)
                return
            if plan.expect != 200:
                tally.failures.append(f"200 for an invalid body {plan.body!r:.200}")
                return
            choices = response.json()["choices"]
            reasons = [c["finish_reason"] for c in choices]
            if len(choices) != n or any(r not in ("stop", "length") for r in reasons):
                tally.failures.append(f"incomplete answer: {reasons}")
                return
            tally.outcomes["completed before its client left" if plan.abandon else "completed"] += 1
            return
        async with client.stream("POST", plan.path, content=content, headers=headers) as response:
            if response.status_code != 200:
                check_error(response.status_code, (await response.aread()).decode(), response.headers, plan, tally)
                return
            if plan.expect != 200:
                tally.failures.append(f"200 for an invalid body {plan.body!r:.200}")
                return
            events, finished = [], set()
            keep = rng.randint(1, 3) if plan.abandon else None
            async for line in response.aiter_lines():
                if not line:
                    continue
                events.append(line)
                if line != "data: [DONE]":
                    payload = json.loads(line.removeprefix("data: "))
                    if "error" in payload:
                        tally.failures.append(f"error event: {payload}")
                        return
                    for choice in payload["choices"]:
                        if choice.get("finish_reason") is not None:
                            finished.add(choice["index"])
                            if choice["finish_reason"] not in ("stop", "length"):
                                tally.failures.append(f"finish_reason {choice['finish_reason']!r} in a stream")
                                return
                if keep is not None and len(events) >= keep:
                    tally.outcomes["abandoned by its client"] += 1
                    return  # leaving the `async with` closes the connection mid-stream
            if events[-1] != "data: [DONE]" or len(finished) != n:
                tally.failures.append(f"stream ended early: {events[-2:]}, finished {sorted(finished)} of {n}")
                return
            tally.outcomes["completed before its client left" if plan.abandon else "completed"] += 1
    except httpx.TimeoutException:
        tally.failures.append(f"no answer within {REQUEST_TIMEOUT} s: {plan.body!r:.200}")
    except httpx.HTTPError as e:
        tally.failures.append(f"{type(e).__name__} {e} for {plan.body!r:.200}")


def run_wave(url: str, seed: int, size: int = WAVE) -> Tally:
    rng = random.Random(seed)
    plans = [plan_request(rng, i) for i in range(size)]
    tally = Tally()

    async def main():
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, limits=limits) as client:
            semaphore = asyncio.Semaphore(CONCURRENCY)

            async def guarded(plan: Plan, i: int):
                async with semaphore:
                    await run_one(client, plan, random.Random(seed * 1000 + i), tally)

            await asyncio.gather(*(guarded(p, i) for i, p in enumerate(plans)))

    asyncio.run(main())
    return tally


def test_soak_loses_nothing_and_leaks_nothing(small_pool):
    url = small_pool.url
    waves, rss = [], []
    before = metric_values(url)
    start = time.monotonic()
    for seed in (1, 2, 3):
        tally = run_wave(url, seed)
        assert not tally.failures, "\n".join(tally.failures[:20])
        settled = wait_for(lambda: idle(url), timeout=15)
        assert settled, f"the server did not go idle after the wave: {metric_values(url)}"
        assert small_pool.proc.poll() is None and httpx.get(url + "/health").status_code == 200
        waves.append(tally.outcomes)
        rss.append(rss_bytes(small_pool.proc.pid))
    seconds = time.monotonic() - start
    after = metric_values(url)

    total = sum(waves, Counter())
    assert sum(total.values()) == 3 * WAVE  # every request has exactly one outcome
    # each kind of outcome happened: the test exercised what it says
    for kind in ("completed", "abandoned by its client", "refused as invalid (400)", "refused as invalid (404)",
                 "rejected: queue full (429)"):
        assert total[kind] > 0, (kind, total)
    finished = finished_counts(after) - finished_counts(before)
    assert finished["error"] == 0
    # every admitted request finished exactly once in the engine's books: the completed ones, plus at most the
    # abandoned ones (one may leave before its request was admitted)
    completed = total["completed"] + total["completed before its client left"]
    assert completed <= sum(finished.values()) <= completed + total["abandoned by its client"], (finished, total)
    # each answer a client got whole was a request the engine finished (stop or length), and the aborted ones
    # were abandoned by their clients: only those that left early may have finished either way
    assert completed <= finished["stop"] + finished["length"] <= completed + total["abandoned by its client"]
    assert finished["abort"] <= total["abandoned by its client"]
    preempted = after["nanovllm:num_preemptions_total"] - before["nanovllm:num_preemptions_total"]
    assert preempted > 0, "the pool was meant to run dry"
    # memory is flat once warm: after 400 more requests the process is no bigger than after the first wave, within
    # allocator noise (a few MiB; 16 MiB is 40 KiB per request: a request's state, kept, would show)
    growth = rss[2] - rss[0]
    assert growth < 16 << 20, f"RSS grew by {growth >> 20} MiB: {[r >> 20 for r in rss]} MiB"
    assert "Traceback" not in small_pool.output(), small_pool.output()[-3000:]
    RESULTS["soak"] = {"waves": len(waves), "requests": sum(total.values()), "outcomes": dict(total),
                       "finished": dict(finished), "preemptions": int(preempted), "seconds": round(seconds, 1),
                       "rss_mib": [round(r / 2**20, 1) for r in rss]}
    print("\nsoak:", json.dumps(RESULTS, indent=1))
