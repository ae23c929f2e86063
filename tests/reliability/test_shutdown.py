"""SIGTERM: no new admissions, requests in flight finish within a bounded grace period, and the process exits 0."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests.server.conftest import ServerProcess

FLAGS = ("--kvcache-block-size", "16", "--num-kvcache-blocks", "256", "--max-num-seqs", "8")
TOKENS = 120


def stream_in_thread(url: str, body: dict, events: list[str], started: threading.Event) -> threading.Thread:
    def run():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        started.set()
        except httpx.HTTPError as e:
            events.append(f"client error: {e!r}")
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def new_request_refused(url: str) -> str:
    """What a request that arrives after SIGTERM gets: never a 200."""
    try:
        response = httpx.post(url + "/v1/completions", json={"prompt": "Too late", "max_tokens": 2}, timeout=10)
    except httpx.HTTPError as e:  # the listening socket is closed: connection refused
        return type(e).__name__
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable"
    return "503"


def test_sigterm_drains_in_flight_requests_and_exits_0(chat_model):
    server = ServerProcess(chat_model, *FLAGS, "--timeout-graceful-shutdown", "30")
    try:
        body = {"prompt": "Finish this.", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        streams = []
        for _ in range(3):
            events: list[str] = []
            started = threading.Event()
            streams.append((events, started, stream_in_thread(server.url, body, events, started)))
        assert all(started.wait(30) for _, started, _ in streams), "no first token"
        with httpx.Client(timeout=10) as keep_alive:  # a connection opened before the signal
            assert keep_alive.get(server.url + "/health").status_code == 200
            signalled = time.monotonic()
            server.terminate()
            time.sleep(0.3)  # uvicorn notices the signal within its 0.1 s tick
            refused = new_request_refused(server.url)
            try:
                late = keep_alive.post(server.url + "/v1/completions", json={"prompt": "Late", "max_tokens": 2})
                assert late.status_code == 503, late.text
            except httpx.HTTPError:
                pass  # uvicorn closed the idle connection: refused as well
        for events, _, thread in streams:
            thread.join(60)
            assert events[-1] == "data: [DONE]", events[-3:]
            usage = json.loads(events[-2].removeprefix("data: "))["usage"]
            assert usage["completion_tokens"] == TOKENS  # every token, though the signal came after the first
        assert server.proc.wait(30) == 0
        seconds = time.monotonic() - signalled
        assert "Traceback" not in server.output(), server.output()[-3000:]
        print(f"\nshutdown: drained 3 streams of {TOKENS} tokens in {seconds:.1f} s, late request: {refused}, exit 0")
    finally:
        server.stop()


def test_grace_period_is_bounded_by_a_stuck_client(chat_model):
    """A client that never finishes sending its request cannot hold the shutdown past the grace period."""
    grace = 1.0
    server = ServerProcess(chat_model, *FLAGS, "--timeout-graceful-shutdown", str(grace))
    try:
        stuck = socket.create_connection(("127.0.0.1", server.port))
        body = json.dumps({"prompt": "Never sent in full", "max_tokens": 2}).encode()
        stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        time.sleep(0.3)
        signalled = time.monotonic()
        server.terminate()
        assert server.proc.wait(30) == 0
        seconds = time.monotonic() - signalled
        stuck.close()
        assert seconds < grace + 10, f"shutdown took {seconds:.1f} s with a grace period of {grace} s"
        print(f"\nshutdown with a stuck client: exited 0 after {seconds:.1f} s (grace {grace} s)")
    finally:
        server.stop()
