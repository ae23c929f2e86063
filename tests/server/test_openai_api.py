"""The server through the official `openai` client: completions, chat (streamed and not), usage, models."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

openai = pytest.importorskip("openai")

from nanovllm import SamplingParams  # noqa: E402

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, how are you?"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def offline(chat_model):
    """The same model run offline: the server's greedy text must equal it."""
    from nanovllm import LLM
    llm = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=64)
    yield llm
    llm.close()


def test_model_list(client, chat_model):
    models = client.models.list().data
    assert [m.id for m in models] == [chat_model]
    assert models[0].object == "model" and models[0].owned_by == "nanovllm"
    assert models[0].model_extra["max_model_len"] == 1024


def test_completion_matches_offline(client, model_name, offline):
    prompt = "The quick brown fox"
    result = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)[0]
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    (choice,) = result.choices
    assert choice.text == expected.outputs[0].text and choice.text
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12


def test_completion_of_several_prompts_and_token_ids(client, model_name, offline):
    token_ids = offline.tokenizer.encode("Once upon a time")
    result = client.completions.create(model=model_name, prompt=["Hello, world!", "Paged attention"],
                                       max_tokens=5, temperature=0)
    assert [c.index for c in result.choices] == [0, 1]
    by_ids = client.completions.create(model=model_name, prompt=token_ids, max_tokens=5, temperature=0)
    expected = offline.generate([{"prompt_token_ids": token_ids}], SamplingParams(temperature=0, max_tokens=5),
                                use_tqdm=False)[0]
    assert by_ids.choices[0].text == expected.outputs[0].text
    assert by_ids.usage.prompt_tokens == len(token_ids)


def test_completion_echo(client, model_name):
    plain = client.completions.create(model=model_name, prompt="Hello", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model_name, prompt="Hello", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello" + plain.choices[0].text


def test_chat_matches_offline(client, model_name, offline):
    result = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=10, temperature=0)
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    (choice,) = result.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_chat_equals_non_streamed(client, model_name):
    kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))

    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    # include_usage: every chunk has a usage field, null but on the last, which has no choices
    *content_chunks, last = chunks
    assert all(c.usage is None for c in content_chunks)
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == 16 == whole.usage.completion_tokens


def test_streamed_completion_equals_non_streamed(client, model_name):
    kwargs = dict(model=model_name, prompt="Continuous batching", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage at all


def test_stream_ends_with_done(server, model_name):
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_tokens_reach_the_client_as_they_are_generated(client, model_name):
    stream = client.completions.create(model=model_name, prompt="The quick brown fox", max_tokens=24,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in stream if c.choices[0].text]
    assert len(pieces) > 1, "the whole text came in one chunk: outputs are not streamed as they are generated"


def test_vllm_extras_in_the_body(client, model_name):
    extra = {"ignore_eos": True}
    if "top_k" in SAMPLING_FIELDS:
        extra["top_k"] = 5
    if "min_p" in SAMPLING_FIELDS:
        extra["min_p"] = 0.05
    result = client.completions.create(model=model_name, prompt="Hello", max_tokens=7, temperature=0.8,
                                       extra_body=extra)
    assert result.usage.completion_tokens == 7 and result.choices[0].finish_reason == "length"


@pytest.mark.skipif("n" not in SAMPLING_FIELDS, reason="the engine has no SamplingParams.n yet")
def test_n_choices(client, model_name):
    result = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, temperature=1.0,
                                            n=3, seed=1)
    assert sorted(c.index for c in result.choices) == [0, 1, 2]


@pytest.mark.skipif("stop" not in SAMPLING_FIELDS, reason="the engine has no SamplingParams.stop yet")
def test_stop_string(client, model_name):
    whole = client.completions.create(model=model_name, prompt="Hello", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stop = whole[3:5]
    assert stop
    cut = client.completions.create(model=model_name, prompt="Hello", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == whole[:whole.index(stop)]


@pytest.mark.skipif("logprobs" not in SAMPLING_FIELDS, reason="the engine has no SamplingParams.logprobs yet")
def test_logprobs(client, model_name):
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)  # greedy: the top token
    completion = client.completions.create(model=model_name, prompt="Hello", max_tokens=3, temperature=0,
                                           logprobs=1, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 3
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_tokenize_and_detokenize(server, offline, model_name):
    text = "Hello, world! Paged attention."
    tokens = httpx.post(server.url + "/tokenize", json={"model": model_name, "prompt": text}).json()
    assert tokens["tokens"] == offline.tokenizer.encode(text)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == offline.apply_chat_template(MESSAGES)
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}


def test_health(server):
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.skipif("prompt_logprobs" not in SAMPLING_FIELDS, reason="the engine has no prompt_logprobs yet")
def test_prompt_logprobs(server, model_name):
    body = {"model": model_name, "prompt": "Hello, world!", "max_tokens": 1, "prompt_logprobs": 1}
    choice = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 7  # "Hello, world!" is 7 tokens
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 2 and all(v["logprob"] <= 0 for v in entry.values())


def test_prefix_cache_hits_show_in_usage(client, model_name):
    prompt = "Paged attention keeps keys and values in fixed-size blocks of one pool. " * 2  # > 2 blocks of 16
    client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_content_parts(client, model_name):
    as_text = client.chat.completions.create(
        model=model_name, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "Hi\nthere"}])
    as_parts = client.chat.completions.create(
        model=model_name, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
