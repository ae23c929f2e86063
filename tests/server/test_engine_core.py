"""The server's engine core in its own process: streamed deltas add up to the plain answer (stop strings, n > 1,
the offline engine's text), an abort frees blocks within a step, and the core's death ends streams and the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_engine import IterationStats
from nanovllm.engine.core_client import AsyncEngineClient
from nanovllm.sampling_params import RequestOutputKind
from nanovllm.server.serve import CPU_FRONT_END_NICENESS
from tests.server.conftest import ENGINE_FLAGS, ServerProcess

PROMPT = "Once upon a time"


def _events(response: httpx.Response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _streamed(url: str, path: str, body: dict) -> dict[int, dict]:
    """Each choice's joined text and token ids, and its finish, from a stream."""
    choices: dict[int, dict] = {}
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        events = _events(response)
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            joined = choices.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None,
                                                     "stop_reason": None})
            joined["text"] += c["text"] if "text" in c else c["delta"].get("content", "")
            joined["token_ids"] += c.get("token_ids", [])
            if c["finish_reason"] is not None:
                assert joined["finish_reason"] is None, "a choice finished twice"
                joined["finish_reason"], joined["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    return choices


def _plain(url: str, path: str, body: dict) -> dict[int, dict]:
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return {c["index"]: {"text": c["text"] if "text" in c else c["message"]["content"], "token_ids": c["token_ids"],
                         "finish_reason": c["finish_reason"], "stop_reason": c.get("stop_reason")}
            for c in response.json()["choices"]}


@pytest.fixture(scope="module")
def offline(chat_model):
    llm = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=256)
    yield llm
    llm.close()


@pytest.mark.parametrize("n", [1, 3])
def test_streamed_deltas_join_to_the_plain_answer_with_stop_strings(server, chat_model, offline, n):
    sample = {"temperature": 0.9, "seed": 7, "max_tokens": 24, "ignore_eos": True}
    # stop strings the answers of this seed really reach (found in a first run without them)
    free = offline.generate([PROMPT], SamplingParams(n=n, **sample), use_tqdm=False)[0].outputs
    stops = [c.text[len(c.text) // 2:len(c.text) // 2 + 3] for c in free if len(c.text) > 8][:2]
    assert stops, [c.text for c in free]
    params = SamplingParams(n=n, stop=stops, **sample)
    expected = offline.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert any(c.finish_reason == "stop" and c.stop_reason in stops for c in expected)
    body = {"model": chat_model, "n": n, "stop": stops, "return_token_ids": True, **sample}
    for path, extra in [("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})]:
        plain = _plain(server.url, path, {**body, **extra})
        assert _streamed(server.url, path, {**body, **extra}) == plain
        if path == "/v1/completions":  # the front end's text and stops equal the in-process engine's
            assert plain == {c.index: {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                       "stop_reason": c.stop_reason} for c in expected}


def test_an_abort_frees_the_blocks_in_the_core(chat_model):
    stats: list[IterationStats] = []
    client = AsyncEngineClient(dict(model=chat_model, kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=4),
                               stats_listeners=[stats.append])
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        stream = client.add_request("Talk forever.", params, "long")
        first = await stream.__anext__()
        assert not first.finished and len(first.outputs[0].token_ids) >= 1
        stream.close()
        for _ in range(200):  # the core answers the abort with a message of its state
            if stats and stats[-1].kv_cache_usage == 0 and stats[-1].num_running == 0:
                return
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert stats[-1].kv_cache_usage == 0 and stats[-1].num_running == 0
        assert max(s.kv_cache_usage for s in stats) > 0
        aborted = [f for s in stats for f in s.finished]
        assert [f.finish_reason for f in aborted] == ["abort"] and aborted[0].num_generation_tokens < 500
        assert client.num_in_flight == 0 and client.is_running
    finally:
        client.shutdown()
    assert not client.is_running and client.error is None


def _core_pid(server_pid: int) -> int:
    """The engine core: the server's child started by multiprocessing's spawn (not its resource tracker)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no engine core process under {server_pid}")


def test_on_the_cpu_the_front_end_runs_below_the_core_s_priority(server):
    core = os.getpriority(os.PRIO_PROCESS, _core_pid(server.proc.pid))
    front_end = os.getpriority(os.PRIO_PROCESS, server.proc.pid)
    assert front_end == min(19, core + CPU_FRONT_END_NICENESS), (front_end, core)


def test_killing_the_core_ends_streams_with_an_error_and_the_server_exits_non_zero(chat_model):
    proc = ServerProcess(chat_model, *ENGINE_FLAGS)
    try:
        body = {"prompt": "Talk forever.", "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")  # it is streaming
            os.kill(_core_pid(proc.proc.pid), signal.SIGKILL)
            rest = [line for line in lines if line]
        killed = time.monotonic()
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert "engine core process died" in error["message"], error
        assert httpx.get(proc.url + "/health", timeout=5).status_code == 503
        again = httpx.post(proc.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
        assert again.status_code == 503, again.text
        status = proc.proc.wait(timeout=15)
        assert status != 0 and time.monotonic() - killed < 15
        assert "engine core process died" in proc.output()
    finally:
        proc.stop()


class _SlowFrontEnd:
    """A pipe end whose sends block until released (a front end busy elsewhere); its reads say stop once the
    engine has nothing left to do."""

    def __init__(self, engine):
        import threading
        self.engine = engine
        self.released = threading.Event()
        self.sent: list[tuple] = []

    def send(self, message):
        self.released.wait(60)
        self.sent.append(message)

    def poll(self):
        return False

    def recv(self):
        return ("stop",)


def test_the_core_steps_on_while_the_front_end_is_behind_and_merges_the_steps_it_queued(chat_model):
    import threading

    from nanovllm.engine.core import EngineCore, core_params
    from nanovllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(chat_model, kvcache_block_size=16, num_kvcache_blocks=64)
    try:
        conn = _SlowFrontEnd(engine)
        core = EngineCore(engine, conn)
        params = core_params(SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, n=2))
        for i in range(3):
            core._add(f"r{i}", [3 + i, 7, 9], params)
        loop = threading.Thread(target=core.run)
        loop.start()
        deadline = time.monotonic() + 60
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished_requests(), "the step loop waited for the front end"
        conn.released.set()
        loop.join(60)
        steps = [m for m in conn.sent if m[0] == "step"]
        assert conn.sent[-1][0] == "stopped"
        assert len(steps) <= 2, f"{len(steps)} step messages: the queued steps were not merged"
        tokens: dict[tuple[str, int], list[int]] = {}
        finishes = {}
        for _, deltas, stats in steps:
            assert len(stats) == 6
            for request_id, index, new, finish, *_ in deltas:
                tokens.setdefault((request_id, index), []).extend(new)
                if finish is not None:
                    finishes[(request_id, index)] = finish
        assert sorted(tokens) == [(f"r{i}", j) for i in range(3) for j in range(2)]
        assert all(len(t) == 12 for t in tokens.values())
        assert set(finishes.values()) == {"length"} and len(finishes) == 6
        assert core.num_sent == {}  # every finished request forgotten
        # the C heap trimmed at the start (loading's garbage) and when the engine went idle (3-token prefills are
        # too small to trim after)
        assert core.heap.num_trims == (2 if core.heap.available else 0)
    finally:
        engine.close()
