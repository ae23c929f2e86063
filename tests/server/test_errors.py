"""Every error a client can cause answers with its status and OpenAI's error shape; none is a 500."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm import SamplingParams
from tests.server.conftest import assert_error

openai = pytest.importorskip("openai")

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 200  # far beyond 1024 tokens
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_json(http, path):
    response = http.post(path, content=b'{"prompt": "Hi", ', headers={"Content-Type": "application/json"})
    error = assert_error(response, 400)
    assert "JSON" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "Hi", "ignore_eos": "maybe"}, "ignore_eos"),
    ({"prompt": "Hi", "no_such_field": 1}, "no_such_field"),
    ({"prompt": "Hi", "suffix": "!"}, "suffix"),
    ({"prompt": "Hi", "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": "Hi", "allowed_token_ids": [100000]}, "allowed_token_ids"),
    ({"prompt": "Hi", "structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"prompt": "Hi", "response_format": {"type": "yaml"}}, "response_format"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": None}, "prompt"),
])
def test_invalid_completion_parameters(http, body, param):
    assert_error(http.post("/v1/completions", json={"max_tokens": 2, **body}), 400, param=param)


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
     "tool_choice"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": CHAT, "stream_options": {"include_usage": "often"}}, "stream_options"),
])
def test_invalid_chat_parameters(http, body, param):
    assert_error(http.post("/v1/chat/completions", json={"max_tokens": 2, **body}), 400, param=param)


def test_prompt_beyond_max_model_len(http):
    error = assert_error(http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1}), 400,
                         code="context_length_exceeded")
    assert "1024" in error["message"]
    messages = [{"role": "user", "content": LONG_PROMPT}]
    assert_error(http.post("/v1/chat/completions", json={"messages": messages}), 400, code="context_length_exceeded")
    assert_error(http.post("/v1/completions", json={"prompt": [5] * 1100, "max_tokens": 1}), 400,
                 code="context_length_exceeded")


def test_prompt_plus_max_tokens_beyond_max_model_len(http):
    error = assert_error(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1024}), 400,
                         param="max_tokens", code="context_length_exceeded")
    assert "1024" in error["message"]
    assert_error(http.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 5000}), 400,
                 code="context_length_exceeded")
    # the same request fits when it leaves room: a prompt of n tokens may ask for max_model_len - n
    n = len(http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"])
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1024 - n + 1}).status_code == 400


def test_unknown_model(http, server):
    for path, body in [("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})]:
        assert_error(http.post(path, json={"model": "gpt-4", **body}), 404, param="model", code="model_not_found")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)
    assert caught.value.code == "model_not_found"


def test_openai_client_sees_bad_request(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=client.models.list().data[0].id, prompt="Hi", temperature=-1)
    assert caught.value.param == "temperature"


def test_unknown_path_and_wrong_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_bad_token_ids_to_detokenize(http):
    assert_error(http.post("/detokenize", json={"tokens": [5, 1 << 30]}), 400, param="tokens")
    assert_error(http.post("/detokenize", json={"tokens": "abc"}), 400)
    assert_error(http.post("/tokenize", json={}), 400)


# -- user input never produces a 500 -----------------------------------------------------------------------------
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2, 5), st.sampled_from([1 << 40, -(1 << 40)]),
                     st.floats(allow_nan=False), st.text(max_size=5))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                             max_size=3), max_leaves=6)
# every SamplingParams field (they pass through to the engine), and the bodies' own
_fields = sorted({f.name for f in dataclasses.fields(SamplingParams)} - {"max_tokens"} | {
    "model", "prompt", "messages", "logprobs", "top_logprobs", "echo", "stream", "stream_options",
    "max_completion_tokens", "add_generation_prompt", "chat_template_kwargs", "tokens", "suffix", "tools",
    "return_token_ids", "tool_choice", "response_format"})
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""])},
                                 optional={"content": _values})


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
       body=st.dictionaries(st.sampled_from(_fields), _values, max_size=4),
       prompt=st.one_of(st.none(), st.text(max_size=8), st.lists(st.integers(-3, 400), max_size=4)),
       messages=st.one_of(st.none(), st.lists(_message, max_size=2)),
       max_tokens=st.sampled_from([1, 2, 0, -1, "x", 2.5, None, 1 << 40]))
def test_fuzzed_bodies_never_give_500(http, path, body, prompt, messages, max_tokens):
    if prompt is not None:
        body.setdefault("prompt", prompt)
    if messages is not None:
        body.setdefault("messages", messages)
    # always a small max_tokens where a valid request could run: the test is about errors, not generation
    body["max_tokens"] = max_tokens if max_tokens is not None else 2
    if isinstance(body.get("max_completion_tokens"), int):
        body["max_completion_tokens"] = min(body["max_completion_tokens"], 2)
    response = http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    elif body.get("stream") is True and path.startswith("/v1/"):
        assert response.text.rstrip().endswith("data: [DONE]")
