"""Request fields are typed as strictly as OpenAI types them: a 400 naming the field, never a silent coercion."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import assert_error

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "Hi", "stream": "true"}, "stream"),
    ("/v1/completions", {"prompt": "Hi", "echo": 0}, "echo"),
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("/v1/completions", {"prompt": [7, 1.0]}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "Hi", "return_token_ids": 1}, "return_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "store": 0}, "store"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": 1}, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "Hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 1, "content": "Hi"}]}, "messages"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": 1}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "nobody", "content": "Hi"}]}, "messages"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [7, 8.0]}, "tokens"),
])
def test_loosely_typed_fields_are_refused_by_name(http, path, body, param):
    error = assert_error(http.post(path, json={"max_tokens": 2, **body} if "v1" in path else body), 400,
                         param=param)
    assert param in error["message"]


def test_role_error_says_which_message_and_the_roles_known(http):
    messages = [{"role": "user", "content": "Hi"}, {"role": "", "content": "?"}]
    error = assert_error(http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}), 400,
                         param="messages")
    assert "messages.1.role" in error["message"] and "'assistant'" in error["message"]


@pytest.mark.parametrize("top", [100, 21, -1])
def test_top_logprobs_out_of_range_is_named_as_sent(http, top):
    body = {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": top}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, param="top_logprobs")
    assert error["message"].startswith("top_logprobs") and str(top) in error["message"]


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_every_openai_role_is_accepted(http, role):
    messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_strict_types_still_take_what_openai_takes(http):
    # integers where numbers are wanted, booleans as booleans, token ids as integers
    body = {"prompt": [[7, 8, 9]], "max_tokens": 2, "temperature": 0, "top_p": 1, "stream": False, "echo": False}
    assert http.post("/v1/completions", json=body).status_code == 200
    body = {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 20, "store": False}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
