"""vLLM's ``return_token_ids``, and serving a model without tokenizer (random weights from config.json alone):
streams still show every token, and the serving benchmark measures it with random token-id prompts."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time

import httpx
import pytest

from tests.server.conftest import ENGINE_FLAGS, REPO_ROOT, ServerProcess

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64]  # shorter than a KV block: no prefix-cache hit between requests


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A server of a tiny Qwen3 shape with dummy weights: a folder with config.json only, so no tokenizer."""
    from tests.helpers import tiny_config
    folder = tmp_path_factory.mktemp("tiny-bare")
    (folder / "config.json").write_text(json.dumps(tiny_config("qwen3").to_dict()))
    proc = ServerProcess(str(folder), "--load-format", "dummy", *ENGINE_FLAGS)
    yield proc
    proc.stop()


def events(url: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a stream, which must end with [DONE]."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_tokenizer_less_stream_shows_every_token(bare):
    # enough tokens that a stream outlasts a few of the event loop's turns, even on a fast core
    body = {"prompt": PROMPT, "max_tokens": 96, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = httpx.post(bare.url + "/v1/completions", json=body, timeout=60).json()
    (choice,) = whole["choices"]
    assert choice["text"] == "" and choice["prompt_token_ids"] == PROMPT
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 96

    chunks = events(bare.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    *token_chunks, last = chunks
    streamed = [t for c in token_chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]
    assert len(streamed) == last["usage"]["completion_tokens"]
    # no tokenizer, so no text: the chunks still come as tokens are made, not all at the end
    assert all(c["choices"][0]["text"] == "" for c in token_chunks)
    assert sum(1 for c in token_chunks if c["choices"][0]["token_ids"]) > 1
    assert token_chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c["choices"][0] for c in token_chunks[1:])


def test_without_return_token_ids_no_ids_but_still_chunks(bare):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(bare.url + "/v1/completions", json=body, timeout=60).json()
    assert "token_ids" not in whole["choices"][0] and "prompt_token_ids" not in whole["choices"][0]
    chunks = events(bare.url, "/v1/completions", body)
    assert all("token_ids" not in c["choices"][0] for c in chunks)
    assert len(chunks) > 1, "a model without tokenizer streamed one chunk: clients see no progress"


def test_return_token_ids_with_a_tokenizer(server, chat_model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    (choice,) = whole["choices"]
    assert choice["prompt_token_ids"] == tokenizer.encode("The quick brown fox")
    assert len(choice["token_ids"]) == 8 == whole["usage"]["completion_tokens"]
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    chunks = events(server.url, "/v1/completions", body)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]

    messages = [{"role": "user", "content": "Hello, how are you?"}]
    chat = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    (choice,) = whole["choices"]
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    assert whole["prompt_token_ids"] == rendered and len(rendered) == whole["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == 6 == whole["usage"]["completion_tokens"]
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    chunks = events(server.url, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


@pytest.fixture(scope="module")
def serving():
    """benchmarks/serving.py as a module (benchmarks/ is no package); registered, as its dataclasses need."""
    spec = importlib.util.spec_from_file_location("serving_benchmark", REPO_ROOT / "benchmarks" / "serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_serving_benchmark_on_a_model_without_tokenizer(bare, serving):
    # 64 tokens a stream: with 5, and once (a fresh clone's suite on 2 busy cores) with 16, every stream's tokens
    # reached the client in one read, which leaves no inter-token gap to measure
    args = serving.parse_args(["--base-url", bare.url, "--num-prompts", "4", "--input-len", "10", "--output-len", "64",
                               "--random-token-range", "10", "300"])
    summary = asyncio.run(serving.run(args))
    assert summary["completed"] == 4 and summary["failed"] == 0, summary["errors"]
    assert summary["total_output_tokens"] == 4 * 64 and summary["total_input_tokens"] == 4 * 10
    assert summary["prompt_token_range"] == [10, 300]
    for key in ("mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms"):
        assert summary[key] > 0, key


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_serving_benchmark_clients_count_the_same_tokens(bare, serving, client):
    args = serving.parse_args(["--base-url", bare.url, "--num-prompts", "3", "--input-len", "8", "--output-len", "6",
                               "--random-token-range", "10", "300", "--client", client])
    summary = asyncio.run(serving.run(args))
    assert summary["client"] == client
    assert summary["completed"] == 3 and summary["failed"] == 0, summary["errors"]
    assert summary["total_output_tokens"] == 3 * 6 and summary["total_input_tokens"] == 3 * 8


def _read_stream(serving, body: bytes, pieces: int = 7):
    result = serving.RequestResult()
    reader = serving.StreamReader(result, time.perf_counter())
    for i in range(0, len(body), pieces):  # events split anywhere across reads
        reader.feed(body[i:i + pieces])
    return reader.finish(), reader


def test_the_benchmark_counts_every_token_of_chunks_that_carry_several(serving):
    events = [{"choices": [{"index": 0, "text": 'a "token_ids":[9,9]', "token_ids": [5, 6, 7],
                            "prompt_token_ids": [1, 2]}], "usage": None},
              {"choices": [{"index": 0, "text": "", "token_ids": []}], "usage": None},
              {"choices": [{"index": 0, "text": "b", "token_ids": [8]}, {"index": 1, "text": "c", "token_ids": [3, 4]}],
               "usage": None},
              {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
    result, reader = _read_stream(serving, body)
    assert result.ok, result.error
    assert reader.tokens == 6 and result.output_len == 6 and result.prompt_len == 2
    assert len(result.itl) == 1  # two chunks carried tokens (the empty one is no inter-token gap)

    short = body.replace(b'"completion_tokens": 6', b'"completion_tokens": 7')
    result, _ = _read_stream(serving, short)
    assert not result.ok and "carried 6 token ids, but usage says 7" in result.error

    result, _ = _read_stream(serving, body[:body.index(b"data: [DONE]")])
    assert not result.ok and "without [DONE]" in result.error

    failed = b'data: {"choices":[{"index":0,"text":"x","token_ids":[1]}]}\n\n' \
             b'data: {"error":{"message":"the engine failed","code":503}}\n\ndata: [DONE]\n\n'
    result, _ = _read_stream(serving, failed)
    assert not result.ok and result.error == "the engine failed"


def test_serving_benchmark_chat_without_tokenizer_is_a_clear_error(bare, serving, capsys):
    assert serving.main(["--base-url", bare.url, "--endpoint", "chat", "--num-prompts", "1"]) == 1
    assert "no tokenizer" in capsys.readouterr().err


def test_serving_benchmark_ids_outside_the_vocabulary_fail_fast(bare, serving, capsys):
    # the default range reaches past this model's 384 ids: the first request says so, nothing more is sent
    assert serving.main(["--base-url", bare.url, "--num-prompts", "50", "--input-len", "64"]) == 1
    assert "outside the vocabulary" in capsys.readouterr().err


def test_token_ids_of_several_prompts_and_samples(bare):
    body = {"prompt": [PROMPT, PROMPT[:5]], "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = httpx.post(bare.url + "/v1/completions", json=body, timeout=60).json()
    expected = {c["index"]: (c["prompt_token_ids"], c["token_ids"]) for c in whole["choices"]}
    assert sorted(expected) == [0, 1, 2, 3] and all(len(ids) == 4 for _, ids in expected.values())
    streamed: dict[int, tuple[list, list]] = {}
    for chunk in events(bare.url, "/v1/completions", body):
        for c in chunk["choices"]:
            if c["index"] not in streamed:  # a choice's first chunk carries its prompt's ids
                streamed[c["index"]] = (c["prompt_token_ids"], [])
            streamed[c["index"]][1].extend(c["token_ids"])
    assert streamed == expected
    assert [expected[i][0] for i in range(4)] == [PROMPT, PROMPT, PROMPT[:5], PROMPT[:5]]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("text", ["", "plain", 'quote " and \\ backslash', "é ü 中 \n\t", "\u2028"])
def test_the_chunk_template_writes_the_same_json_as_the_chunk_dict(include_usage, return_token_ids, text):
    from nanovllm.server.app import _ChunkTemplate, _event
    template = _ChunkTemplate("cmpl-\"x\"", "text_completion", 1790000000, "models/é", include_usage,
                              return_token_ids)
    envelope = {"id": "cmpl-\"x\"", "object": "text_completion", "created": 1790000000, "model": "models/é"}
    tail = {"usage": None} if include_usage else {}
    ids = {"token_ids": [5, 17]} if return_token_ids else {}
    common = {"logprobs": None, "finish_reason": None, "stop_reason": None, **ids}
    expected = _event({**envelope, "choices": [{"index": 3, "text": text, **common}], **tail})
    assert template.completion(3, text, [5, 17]) == expected
    delta = {"content": text}
    expected = _event({**envelope, "choices": [{"index": 1, "delta": delta, **common}], **tail})
    assert template.chat(1, delta, [5, 17]) == expected
