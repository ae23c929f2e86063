"""``--api-server-count 2``: two front-end processes on one port in front of one engine core. Requests served by
either process stream every token once, equal to the plain answer; /metrics on either counts both; SIGTERM
drains, also while the front ends start; killing the core ends every stream with an error event and the server exits non-zero.

One server for the module (its last test kills its core), and one more for the drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ENGINE_FLAGS, REPO_ROOT, ServerProcess, free_port, metric_values
from tests.server.test_engine_core import _events

HEADER = "x-nanovllm-front-end"
PROMPTS = [f"Story number {i}: once upon a time" for i in range(24)]


@pytest.fixture(scope="module")
def two(chat_model):
    proc = ServerProcess(chat_model, *ENGINE_FLAGS, "--api-server-count", "2")
    yield proc
    proc.stop()


def _stream(url: str, prompt: str, max_tokens: int = 6) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        front_end = response.headers[HEADER]
        events = _events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("error" not in c for c in chunks), chunks
    choices = [c for chunk in chunks for c in chunk["choices"]]
    return {"front_end": front_end, "text": "".join(c["text"] for c in choices),
            "token_ids": [t for c in choices for t in c["token_ids"]],
            "finishes": [c["finish_reason"] for c in choices if c["finish_reason"]], "usage": chunks[-1]["usage"]}


def _plain(url: str, prompt: str, max_tokens: int = 6) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    return {"front_end": response.headers[HEADER], "text": choice["text"], "token_ids": choice["token_ids"]}


def test_requests_on_both_front_ends_stream_each_token_once_and_equal_the_plain_answer(two):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: the kernel spreads the connections
        streamed = list(pool.map(lambda p: _stream(two.url, p), PROMPTS))
        plain = list(pool.map(lambda p: _plain(two.url, p), PROMPTS))
    served_by = {r["front_end"] for r in streamed + plain}
    for _ in range(32):  # the kernel hashes each connection to a front end: a few may all land on one
        if len(served_by) == 2:
            break
        served_by.add(_plain(two.url, PROMPTS[0])["front_end"])
    assert served_by == {"0", "1"}, f"every request went to front end {served_by}"
    for s, p in zip(streamed, plain, strict=True):
        assert s["token_ids"] == p["token_ids"] and len(s["token_ids"]) == 6
        assert s["text"] == p["text"]
        assert s["finishes"] == ["length"]
        assert s["usage"]["completion_tokens"] == 6


def test_metrics_on_either_front_end_count_the_requests_of_both(two):
    before = metric_values(two.url)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served_by = {r["front_end"] for r in pool.map(lambda p: _plain(two.url, p, 4), PROMPTS)}
    assert served_by == {"0", "1"}
    for _ in range(4):  # whichever front end answers /metrics, it sums both
        after = metric_values(two.url)
        assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] == 4 * len(
            PROMPTS)
        assert after['nanovllm:request_success_total{finished_reason="length"}'] - before[
            'nanovllm:request_success_total{finished_reason="length"}'] == len(PROMPTS)
        assert after["nanovllm:num_requests_running"] == 0
        assert after["nanovllm:e2e_request_latency_seconds_count"] - before[
            "nanovllm:e2e_request_latency_seconds_count"] == len(PROMPTS)


def _spawned_children(pid: int) -> list[int]:
    """multiprocessing's spawned children of ``pid``, oldest first (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            found.append((int(fields[19]), int(entry.name)))  # start time, pid
    return [p for _, p in sorted(found)]


def _streams_begun(url: str, count: int, max_tokens: int):
    """``count`` streams that have each had a chunk: a pool, its futures of (front end, lines)."""
    import threading
    begun = threading.Semaphore(0)
    body = {"prompt": "Go on.", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}

    def stream() -> tuple[str, list]:
        told = False
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                first = next(line for line in lines if line)
                begun.release()
                told = True
                return response.headers[HEADER], [first, *(line for line in lines if line)]
        finally:
            if not told:  # (failed before its first chunk: the test fails on its result, not by waiting)
                begun.release()

    pool = ThreadPoolExecutor(count)
    futures = [pool.submit(stream) for _ in range(count)]
    for _ in range(count):
        assert begun.acquire(timeout=30)
    return pool, futures


def test_sigterm_drains_both_front_ends_and_exits_zero(chat_model):
    proc = ServerProcess(chat_model, *ENGINE_FLAGS, "--api-server-count", "2")
    try:
        pool, futures = _streams_begun(proc.url, 8, 40)
        proc.terminate()
        results = [f.result(timeout=60) for f in futures]
        pool.shutdown()
        for _, lines in results:
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-2:]
        assert proc.proc.wait(timeout=30) == 0
    finally:
        proc.stop()


def test_sigterm_while_the_front_ends_start_still_drains_and_exits_zero(chat_model):
    # the signal reaches the front ends (forwarded) before either has its server's handlers
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.server.serve", chat_model, "--port", str(free_port()),
                             "--log-level", "warning", *ENGINE_FLAGS, "--api-server-count", "2"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_spawned_children(proc.pid)) < 3:  # the core (loaded by then), then the two front ends
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_killing_the_core_ends_the_streams_of_both_front_ends_and_the_server_exits_non_zero(two):
    # (the last test of the module: it ends the module's server)
    core = _spawned_children(two.proc.pid)[0]  # started before the front ends
    pool, futures = _streams_begun(two.url, 8, 1000)
    os.kill(core, signal.SIGKILL)
    killed = time.monotonic()
    results = [f.result(timeout=30) for f in futures]
    pool.shutdown()
    assert {front_end for front_end, _ in results} == {"0", "1"}
    for _, lines in results:
        assert lines[-1] == "data: [DONE]"
        assert "engine core process died" in lines[-2], lines[-2]
    assert httpx.get(two.url + "/health", timeout=5).status_code == 503
    status = two.proc.wait(timeout=20)
    assert status != 0 and time.monotonic() - killed < 20
