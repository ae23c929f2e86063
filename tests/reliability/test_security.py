"""Security defaults, checked by behaviour: loopback bind, an API key on every route but /health and /metrics,
no model chosen by a request, no client data evaluated or unpickled, and limits on what one request may ask."""

from __future__ import annotations

import builtins
import json
import marshal
import os
import pickle
import socket
import uuid
from pathlib import Path

import httpx
import pytest

from nanovllm.server.serve import API_KEY_ENV
from tests.reliability.conftest import serve_in_thread
from tests.server.conftest import ServerProcess

KEY = "sk-reliability-" + uuid.uuid4().hex
OPEN = {"/health", "/metrics"}


@pytest.fixture(scope="module")
def keyed(chat_model):
    """A server that takes its API key from the environment, started without --host."""
    proc = ServerProcess(chat_model, "--kvcache-block-size", "16", "--num-kvcache-blocks", "64",
                         "--served-model-name", "tiny", env={API_KEY_ENV: KEY})
    yield proc
    proc.stop()


# -- bind -----------------------------------------------------------------------------------------------------------
def listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on ``port`` (Linux /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if int(port_hex, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            if len(raw) == 4:
                found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_the_server_binds_loopback_unless_told_otherwise(keyed):
    from nanovllm.cli import build_parser

    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("needs Linux /proc to see the listening socket")
    assert listening_addresses(keyed.port) == {"127.0.0.1"}  # the server above was started without --host


def test_limits_have_bounded_defaults():
    from nanovllm.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.max_request_body_bytes == 8 << 20
    assert args.max_n == 128 and args.max_prompts_per_request == 1024
    assert args.timeout_graceful_shutdown == 30.0


# -- the API key ---------------------------------------------------------------------------------------------------
def test_the_api_key_from_the_environment_guards_every_route(keyed):
    schema = httpx.get(keyed.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    routes = {(path, method.upper()) for path, methods in schema["paths"].items() for method in methods}
    routes |= {("/openapi.json", "GET"), ("/docs", "GET"), ("/redoc", "GET")}
    assert {p for p, _ in routes if p.startswith("/v1/")} >= {"/v1/models", "/v1/completions",
                                                              "/v1/chat/completions"}
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"},
             {"Authorization": f"Basic {KEY}"}, {"X-API-Key": KEY}]
    checked = 0
    for path, method in sorted(routes):
        body = {"prompt": "Hi", "max_tokens": 1} if method == "POST" else None
        for headers in wrong:
            response = httpx.request(method, keyed.url + path, json=body, headers=headers)
            checked += 1
            if path in OPEN:
                assert response.status_code == 200, (path, response.text)
            else:
                assert response.status_code == 401, (path, headers, response.text)
                assert response.json()["error"]["code"] == "invalid_api_key"
        good = httpx.request(method, keyed.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert good.status_code != 401, path
    # near-misses of the open paths are not open
    for path in ("/health/", "/metrics/x", "/health/../v1/models", "//v1/models", "/V1/models", "/v1/models/"):
        assert httpx.get(keyed.url + path).status_code == 401, path
    print(f"\napi key: {len(routes)} routes x {len(wrong)} wrong keys = {checked} requests checked")


# -- in process: what the server does with a request's data ------------------------------------------------------
@pytest.fixture(scope="module")
def inproc(chat_model):
    from nanovllm import LLM
    from nanovllm.engine.async_engine import AsyncLLM
    from nanovllm.server.app import build_app

    llm = AsyncLLM(LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=64))
    with serve_in_thread(build_app(llm, served_model_names=["tiny"])) as url:
        yield url


def marked_requests(marker: str, model_path: str) -> list[tuple[str, dict]]:
    """Requests with the marker in every string a client controls (and some model paths as model names)."""
    m = marker
    messages = [{"role": "system", "content": f"sys {m}"}, {"role": "user", "content": [{"type": "text", "text": m}],
                                                            "name": m}]
    return [
        ("/v1/completions", {"prompt": f"hello {m}", "stop": [m], "user": m, "max_tokens": 2, "echo": True}),
        ("/v1/completions", {"prompt": f"hello {m}", "max_tokens": 2, "stream": True, "logprobs": 1}),
        ("/v1/completions", {"prompt": "hi", "model": model_path, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "model": f"/tmp/{m}/model", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "model": f"../../{m}", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", m: m, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {m: 1}, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": m}, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": messages, "stop": m, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                  "chat_template_kwargs": {"chat_template": "{{ '" + m + "' }}"}}),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "chat_template_kwargs": {m: m}}),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "tools": [{"function": {"name": m}}]}),
        ("/v1/chat/completions", {"messages": messages, "model": f"/tmp/{m}", "max_tokens": 2}),
        ("/tokenize", {"prompt": m, "model": model_path}),
        ("/tokenize", {"messages": messages, "chat_template_kwargs": {"chat_template": m}}),
        ("/detokenize", {"tokens": [5, 6], "model": f"/tmp/{m}"}),
    ]


def test_requests_never_choose_what_the_server_loads(inproc, chat_model, monkeypatch):
    """A model name that is a path (even the served model's own path, or one that exists) is only a name: it gets
    404 unless served under that name, and nothing is opened, stat'ed or loaded from it."""
    import nanovllm.engine.llm_engine as llm_engine
    import nanovllm.loader.source as source

    marker = "m" + uuid.uuid4().hex
    touched: list[str] = []

    def spy(name, original):
        def wrapper(path, *args, **kwargs):
            if marker in str(path) or str(path).startswith(chat_model):
                touched.append(f"{name}({path})")
            return original(path, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(builtins, "open", spy("open", builtins.open))
    monkeypatch.setattr(os, "open", spy("os.open", os.open))
    monkeypatch.setattr(os, "stat", spy("os.stat", os.stat))
    monkeypatch.setattr(source, "resolve_model", spy("resolve_model", source.resolve_model))
    monkeypatch.setattr(llm_engine, "resolve_model", spy("resolve_model", llm_engine.resolve_model))
    statuses = {}
    for path, body in marked_requests(marker, chat_model):
        if "model" in body:
            statuses[body["model"]] = httpx.post(inproc + path, json=body, timeout=30).status_code
    assert set(statuses.values()) == {404}, statuses
    assert touched == []


def test_client_data_is_never_evaluated_or_unpickled(inproc, monkeypatch):
    """Every string a client sends carries a marker; none reaches eval, exec, compile (a chat template is compiled
    Python), pickle or marshal."""
    marker = "m" + uuid.uuid4().hex
    reached: list[str] = []

    def spy(name, original):
        def wrapper(source, *args, **kwargs):
            text = source.decode("latin-1") if isinstance(source, (bytes, bytearray)) else str(source)
            if marker in text:
                reached.append(name)
            return original(source, *args, **kwargs)
        return wrapper

    for module, name in [(builtins, "eval"), (builtins, "exec"), (builtins, "compile"), (pickle, "loads"),
                         (pickle, "load"), (marshal, "loads")]:
        monkeypatch.setattr(module, name, spy(f"{module.__name__}.{name}", getattr(module, name)))
    statuses = []
    for path, body in marked_requests(marker, "tiny"):
        response = httpx.post(inproc + path, json=body, timeout=30)
        assert response.status_code < 500, response.text
        statuses.append(response.status_code)
    assert 200 in statuses and 400 in statuses  # some were served, some refused: both paths ran
    assert reached == [], f"client data reached {reached}"
    # the refusals that matter: a client's chat template is never compiled
    response = httpx.post(inproc + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}})
    assert response.status_code == 400 and "chat_template" in json.dumps(response.json())
