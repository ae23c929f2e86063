"""A server started with an API key and limits: 401, 413, 429 with Retry-After, and a graceful SIGTERM drain."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server.conftest import ServerProcess, assert_error, metric_values, wait_for

openai = pytest.importorskip("openai")

KEY = "sk-test-0123456789"
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def strict(chat_model):
    # one request at a time and no queue, so a second concurrent request is refused with 429
    proc = ServerProcess(chat_model, "--kvcache-block-size", "16", "--num-kvcache-blocks", "128",
                         "--max-num-seqs", "1", "--max-queued-requests", "0",
                         "--max-request-body-bytes", str(BODY_LIMIT), "--api-key", KEY,
                         "--served-model-name", "tiny", "tiny-alias")
    yield proc
    proc.stop()


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_required(strict):
    body = {"prompt": "Hi", "max_tokens": 2}
    for headers in ({}, auth("wrong"), {"Authorization": KEY}, auth(KEY + "x")):
        for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")]:
            response = httpx.request(method, strict.url + path, json=body, headers=headers)
            assert assert_error(response, 401)["code"] == "invalid_api_key"
    assert httpx.post(strict.url + "/v1/completions", json=body, headers=auth()).status_code == 200
    # health and metrics stay open
    assert httpx.get(strict.url + "/health").status_code == 200
    assert "nanovllm:num_requests_running" in httpx.get(strict.url + "/metrics").text


def test_openai_client_with_and_without_the_key(strict):
    with openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=strict.url + "/v1", api_key=KEY, max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
        result = client.completions.create(model="tiny-alias", prompt="Hi", max_tokens=2)
        assert result.model == "tiny"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="Hi", max_tokens=2)


def test_body_too_large(strict):
    big = {"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}
    assert assert_error(httpx.post(strict.url + "/v1/completions", json=big, headers=auth()), 413)
    # a chunked body (no Content-Length) is counted as it arrives
    chunks = iter([json.dumps(big).encode()[i:i + 1000] for i in range(0, BODY_LIMIT + 1100, 1000)])
    response = httpx.post(strict.url + "/v1/completions", content=chunks,
                          headers={**auth(), "Content-Type": "application/json"})
    assert_error(response, 413)


def test_queue_full_gives_429_with_retry_after(strict):
    body = {"prompt": "Talk for a while.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=auth()) as client:
        with client.stream("POST", strict.url + "/v1/completions", json=body) as busy:
            assert busy.status_code == 200
            lines = busy.iter_lines()  # kept: a dropped iterator would close the stream, and so abort it
            next(line for line in lines if line)  # a first token: the engine holds the request
            refused = client.post(strict.url + "/v1/completions", json={"prompt": "Me too", "max_tokens": 2})
            error = assert_error(refused, 429)
            assert error["code"] == "queue_full"
            assert int(refused.headers["Retry-After"]) >= 1
    # the first one left (and was aborted): room again
    assert wait_for(lambda: metric_values(strict.url)["nanovllm:num_requests_running"] == 0)
    ok = httpx.post(strict.url + "/v1/completions", json={"prompt": "Me too", "max_tokens": 2}, headers=auth())
    assert ok.status_code == 200


def test_sigterm_drains_in_flight_requests(strict):
    """Last in this module: SIGTERM stops the server, but only after the request in flight has finished."""
    body = {"prompt": "Finish this.", "max_tokens": 100, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[str] = []
    streaming = threading.Event()

    def client():
        with httpx.stream("POST", strict.url + "/v1/completions", json=body, headers=auth(), timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    streaming.set()

    thread = threading.Thread(target=client)
    thread.start()
    assert streaming.wait(30)  # a first token has arrived: the request is in flight
    strict.terminate()
    at_signal = len(events)
    thread.join(60)
    assert len(events) > at_signal + 2  # tokens kept coming after SIGTERM
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 100
    # uvicorn re-raises the signal once it has shut down cleanly
    assert strict.proc.wait(30) == 0
