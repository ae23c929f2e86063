"""A bad-input matrix over the offline API and every endpoint, and property-based fuzzing of the request bodies.

Whatever a client sends, the answer is a result or an error that names the problem: a ValueError offline, a 4xx
in OpenAI's error shape online; never a 500, never a hang, and the server stays healthy.
"""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm import LLM, SamplingParams
from tests.server.conftest import ServerProcess, assert_error, metric_values, wait_for

MAX_MODEL_LEN = 256
MAX_N = 4
MAX_PROMPTS = 8
BODY_LIMIT = 64 << 10
CHAT = [{"role": "user", "content": "Hi"}]
ODD_TEXT = ["\x00", "a\x00b", "\u202eevil\u202c", "\u200f\u05e9\u05dc\u05d5\u05dd", "😀👍🏽", "👩‍👩‍👧", "\ufeff",
            "e\u0301\u0301\u0301", "\uffff", "\U0010ffff", "\r\n\t", "<|im_start|>", "</s>", "{{ 7*7 }}", "%s%n"]
LONE_SURROGATES = ["\ud800", "a\udfffb", "\ud83d"]  # the last: half of an emoji

TALLY: dict[str, int] = {}  # cases run per group, for docs/reliability.md (printed with -s)


def count(group: str) -> None:
    TALLY[group] = TALLY.get(group, 0) + 1


# -- offline ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(chat_model):
    engine = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=64)
    yield engine
    engine.close()


GOOD_IDS = [7, 8, 9]
GREEDY = SamplingParams(temperature=0, max_tokens=3)


@pytest.mark.parametrize("prompt", [
    None, 5, 3.5, {"foo": 1}, {"prompt_token_ids": "abc"}, {"prompt_token_ids": []}, "", [], [True], [-1], [384],
    [10**30], [1.5], [float("nan")], ["7"], list(range(3, 80)), "\ud800 lone", "x" * 70 * 4,
], ids=repr)
def test_offline_bad_prompt_is_a_value_error(llm, prompt):
    count("offline: bad prompts")
    with pytest.raises(ValueError):
        llm.generate([GOOD_IDS, prompt], GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests(), "a rejected batch queues nothing"
    assert len(llm.generate([GOOD_IDS], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs", [
    dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=-1), dict(temperature="hot"),
    dict(top_p=0), dict(top_p=1.5), dict(top_p=math.nan), dict(top_k=-2), dict(top_k=1.5), dict(min_p=2),
    dict(n=0), dict(n=-1), dict(n=1.5), dict(n="2"), dict(max_tokens=0), dict(max_tokens=-1), dict(max_tokens=1.5),
    dict(max_tokens=math.nan), dict(min_tokens=5, max_tokens=2), dict(min_tokens=-1), dict(logprobs=21),
    dict(logprobs=-2), dict(prompt_logprobs=10**6), dict(stop=[""]), dict(stop=5), dict(stop=[5]),
    dict(stop_token_ids=[-1]), dict(stop_token_ids="x"), dict(seed="x"), dict(seed=1.5),
    dict(presence_penalty=3), dict(frequency_penalty=math.nan), dict(repetition_penalty=0),
    dict(ignore_eos="yes"), dict(detokenize=False, stop=["x"]),
], ids=repr)
def test_offline_bad_sampling_params_are_value_errors(kwargs):
    count("offline: bad sampling params")
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(stop_token_ids=[384]), dict(stop_token_ids=[10**30])], ids=repr)
def test_offline_params_beyond_the_model_are_value_errors(llm, kwargs):
    count("offline: params beyond the model")
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([GOOD_IDS], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=10**18), dict(top_k=10**30), dict(seed=2**70), dict(seed=-5), dict(temperature=1e300),
    dict(repetition_penalty=1e300), dict(n=3, seed=0),
], ids=repr)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e300 becomes inf in float32: still valid
def test_offline_huge_but_valid_numbers_are_served(llm, kwargs):
    """Huge values inside a parameter's range are served: max_tokens stops at max_model_len, top_k beyond the
    vocabulary keeps it all, seeds wrap to 64 bits."""
    count("offline: huge but valid numbers")
    out = llm.generate([GOOD_IDS], SamplingParams(**kwargs), use_tqdm=False)[0]
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    assert all(len(c.token_ids) + len(GOOD_IDS) <= 64 for c in out.outputs)
    assert not llm.has_unfinished_requests() and llm.scheduler.block_manager.usage == 0


@pytest.mark.parametrize("text", ODD_TEXT, ids=repr)
def test_offline_odd_unicode_in_prompts_and_stop_strings(llm, text):
    count("offline: odd Unicode")
    out = llm.generate([text + " hello"], SamplingParams(max_tokens=4, stop=[text], seed=0), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert llm.scheduler.block_manager.usage == 0


# -- every endpoint -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(chat_model):
    proc = ServerProcess(chat_model, "--kvcache-block-size", "16", "--num-kvcache-blocks", "128",
                         "--max-model-len", str(MAX_MODEL_LEN), "--max-n", str(MAX_N),
                         "--max-prompts-per-request", str(MAX_PROMPTS), "--max-request-body-bytes", str(BODY_LIMIT),
                         "--served-model-name", "tiny")
    yield proc
    assert "Traceback" not in proc.output(), proc.output()[-3000:]
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


C, CH, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
J = "application/json"


def body_of(value) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value).encode()  # NaN, Infinity as JS literals


def case(group, path, body, status, param="any", words=()):
    return pytest.param(group, path, body, status, param, words, id=f"{group}: {path} {body!r:.70}")


MATRIX = [
    # wrong types
    case("wrong type", C, {"prompt": 5}, 400, "prompt"),
    case("wrong type", C, {"prompt": {"a": 1}}, 400, "prompt"),
    case("wrong type", C, {"prompt": [1.5]}, 400, "prompt"),
    case("wrong type", C, {"prompt": [[1], [2.5]]}, 400, "prompt"),
    case("wrong type", C, {"prompt": True}, 400, "prompt"),
    case("wrong type", C, {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    case("wrong type", C, {"prompt": "Hi", "max_tokens": [1]}, 400, "max_tokens"),
    case("wrong type", C, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    case("wrong type", C, {"prompt": "Hi", "n": "x"}, 400, "n"),
    case("wrong type", C, {"prompt": "Hi", "stop": 5}, 400, "stop"),
    case("wrong type", C, {"prompt": "Hi", "stop": [5]}, 400, "stop"),
    case("wrong type", C, {"prompt": "Hi", "stream": "maybe"}, 400, "stream"),
    case("wrong type", C, {"prompt": "Hi", "seed": "x"}, 400, "seed"),
    case("wrong type", C, {"prompt": "Hi", "echo": {}}, 400, "echo"),
    case("wrong type", C, {"prompt": "Hi", "stream_options": []}, 400, "stream_options"),
    case("wrong type", CH, {"messages": "hi"}, 400, "messages"),
    case("wrong type", CH, {"messages": [{"role": 1, "content": "x"}]}, 400, "messages"),
    case("wrong type", CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    case("wrong type", CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    case("wrong type", CH, {"messages": CHAT, "max_completion_tokens": "x"}, 400, "max_completion_tokens"),
    case("wrong type", CH, {"messages": CHAT, "chat_template_kwargs": []}, 400, "chat_template_kwargs"),
    case("wrong type", TOK, {"prompt": 5}, 400, "prompt"),
    case("wrong type", DETOK, {"tokens": "abc"}, 400, "tokens"),
    case("wrong type", DETOK, {"tokens": [1.5]}, 400, "tokens"),
    case("wrong type", C, b"[1, 2]", 400),
    case("wrong type", C, b'"a string"', 400),
    case("wrong type", C, b"null", 400),
    # missing fields
    case("missing field", C, {}, 400, "prompt"),
    case("missing field", C, {"max_tokens": 2}, 400, "prompt"),
    case("missing field", CH, {}, 400, "messages"),
    case("missing field", CH, {"messages": [{"content": "no role"}]}, 400, "messages"),
    case("missing field", TOK, {}, 400),
    case("missing field", DETOK, {}, 400, "tokens"),
    case("missing field", C, b"", 400),
    # negative numbers
    case("negative", C, {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    case("negative", C, {"prompt": "Hi", "n": -1}, 400, "n"),
    case("negative", C, {"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    case("negative", C, {"prompt": "Hi", "top_k": -5}, 400, "top_k"),
    case("negative", C, {"prompt": "Hi", "logprobs": -1}, 400, "logprobs"),
    case("negative", C, {"prompt": "Hi", "presence_penalty": -3}, 400, "presence_penalty"),
    case("negative", C, {"prompt": "Hi", "min_tokens": -1}, 400, "min_tokens"),
    case("negative", C, {"prompt": [-1]}, 400, "prompt"),
    case("negative", CH, {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    case("negative", DETOK, {"tokens": [-1]}, 400, "tokens"),
    # huge numbers
    case("huge", C, {"prompt": "Hi", "max_tokens": 10**30}, 400, "max_tokens", (str(MAX_MODEL_LEN),)),
    case("huge", C, {"prompt": "Hi", "n": 10**12}, 400, "n", (f"at most {MAX_N}",)),
    case("huge", C, {"prompt": "Hi", "logprobs": 10**6}, 400, "logprobs", ("20",)),
    case("huge", C, {"prompt": "Hi", "presence_penalty": 1e308}, 400, "presence_penalty"),
    case("huge", C, {"prompt": "Hi", "stop_token_ids": [10**30]}, 400, "stop_token_ids"),
    case("huge", C, {"prompt": "Hi", "min_tokens": 10**30}, 400, "min_tokens"),
    case("huge", C, {"prompt": [10**30]}, 400, "prompt"),
    case("huge", C, {"prompt": [1e400]}, 400, "prompt"),
    case("huge", DETOK, {"tokens": [10**30]}, 400, "tokens"),
    case("huge", C, {"prompt": "Hi", "max_tokens": 2, "top_k": 10**30}, 200),  # beyond the vocabulary: all of it
    case("huge", C, {"prompt": "Hi", "max_tokens": 2, "seed": 2**70}, 200),  # wraps to 64 bits
    case("huge", C, {"prompt": "Hi", "max_tokens": 2, "temperature": 1e308}, 200),
    # NaN and Infinity (Python's JSON reads them; JSON proper has no such numbers)
    case("NaN/Infinity", C, b'{"prompt": "Hi", "temperature": NaN}', 400, "temperature"),
    case("NaN/Infinity", C, b'{"prompt": "Hi", "top_p": Infinity}', 400, "top_p"),
    case("NaN/Infinity", C, b'{"prompt": "Hi", "max_tokens": NaN}', 400, "max_tokens"),
    case("NaN/Infinity", C, b'{"prompt": "Hi", "n": Infinity}', 400, "n"),
    case("NaN/Infinity", C, b'{"prompt": "Hi", "seed": -Infinity}', 400, "seed"),
    case("NaN/Infinity", C, b'{"prompt": "Hi", "presence_penalty": NaN}', 400, "presence_penalty"),
    case("NaN/Infinity", C, b'{"prompt": "Hi", "top_k": NaN}', 400, "top_k"),
    case("NaN/Infinity", C, b'{"prompt": "Hi", "min_p": Infinity}', 400, "min_p"),
    case("NaN/Infinity", C, b'{"prompt": "Hi", "repetition_penalty": NaN}', 400, "repetition_penalty"),
    case("NaN/Infinity", C, b'{"prompt": [NaN]}', 400, "prompt"),
    case("NaN/Infinity", CH, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": -Infinity}', 400,
         "temperature"),
    case("NaN/Infinity", DETOK, b'{"tokens": [Infinity]}', 400, "tokens"),
    # empty and oversized prompts
    case("empty prompt", C, {"prompt": ""}, 400, "prompt", ("empty",)),
    case("empty prompt", C, {"prompt": []}, 400, "prompt", ("empty",)),
    case("empty prompt", C, {"prompt": [""]}, 400, "prompt"),
    case("empty prompt", C, {"prompt": [[]]}, 400, "prompt"),
    case("empty prompt", CH, {"messages": []}, 400, "messages"),
    case("oversized prompt", C, {"prompt": [5] * 300}, 400, "prompt", (str(MAX_MODEL_LEN),)),
    case("oversized prompt", C, {"prompt": "fox " * 400}, 400, "prompt", (str(MAX_MODEL_LEN),)),
    case("oversized prompt", C, {"prompt": "x" * 60000}, 400, "prompt", (str(MAX_MODEL_LEN),)),
    case("oversized prompt", CH, {"messages": [{"role": "user", "content": "fox " * 400}]}, 400, "prompt",
         (str(MAX_MODEL_LEN),)),
    case("oversized prompt", CH, {"messages": [{"role": "user", "content": "x" * 60000}]}, 400, "messages",
         (str(MAX_MODEL_LEN),)),
    case("oversized prompt", TOK, {"prompt": "x" * 60000}, 400, "prompt"),
    case("oversized prompt", C, {"prompt": ["Hi"] * (MAX_PROMPTS + 1)}, 400, "prompt", (str(MAX_PROMPTS),)),
    # beyond the limits
    case("beyond limits", C, {"prompt": "Hi", "n": MAX_N + 1}, 400, "n", (f"at most {MAX_N}",)),
    case("beyond limits", CH, {"messages": CHAT, "n": MAX_N + 1}, 400, "n", (f"at most {MAX_N}",)),
    case("beyond limits", C, {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens",
         (str(MAX_MODEL_LEN),)),
    case("beyond limits", CH, {"messages": CHAT, "max_completion_tokens": 10**6}, 400, "max_tokens",
         (str(MAX_MODEL_LEN),)),
    case("beyond limits", C, {"prompt": "Hi", "best_of": 3}, 400, "best_of"),
    case("beyond limits", C, {"prompt": "Hi", "logit_bias": {"5": 101}}, 400, "logit_bias", ("[-100, 100]",)),
    case("beyond limits", C, {"prompt": "Hi", "logit_bias": {"100000": 1}}, 400, "logit_bias", ("vocabulary",)),
    case("beyond limits", CH, {"messages": CHAT, "tools": [{"type": "function", "function": {}}]},
         400, "tools", ("name",)),
    case("beyond limits", CH, {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 3}}}}, 400, "response_format", ("properties",)),
    case("beyond limits", C, {"prompt": "Hi", "no_such_field": 1}, 400, "no_such_field"),
    # unknown model: names and paths alike; a request never chooses what the server loads
    case("unknown model", C, {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    case("unknown model", C, {"prompt": "Hi", "model": "../../etc/passwd"}, 404, "model"),
    case("unknown model", CH, {"messages": CHAT, "model": "/tmp/some-model"}, 404, "model"),
    case("unknown model", TOK, {"prompt": "Hi", "model": "other"}, 404, "model"),
    case("unknown model", DETOK, {"tokens": [5], "model": "other"}, 404, "model"),
    # invalid UTF-8, and JSON that is not UTF-8 text
    case("invalid UTF-8", C, b'{"prompt": "\xff\xfe"}', 400),
    case("invalid UTF-8", C, b'{"prompt": "\xc0\xaf overlong"}', 400),
    case("invalid UTF-8", C, b'{"prompt": "caf\xe9"}', 400),
    case("invalid UTF-8", CH, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', 400),
    case("invalid UTF-8", TOK, b'{"prompt": "\x80"}', 400),
    # lone surrogates, escaped in valid JSON
    *[case("lone surrogate", C, {"prompt": s}, 400, "prompt", ("surrogate",)) for s in LONE_SURROGATES],
    case("lone surrogate", C, {"prompt": "Hi", "stop": ["\ud83d"]}, 400, "stop"),
    case("lone surrogate", C, {"prompt": "Hi", "model": "\udfff"}, 400, "model"),
    case("lone surrogate", C, {"prompt": "Hi", "user": "\ud800"}, 400, "user"),
    case("lone surrogate", C, {"prompt": "Hi", "\ud800": 1}, 400),
    case("lone surrogate", CH, {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages"),
    case("lone surrogate", CH, {"messages": [{"role": "user", "content": "x", "name": "\udc00"}]}, 400, "messages"),
    case("lone surrogate", CH, {"messages": CHAT, "chat_template_kwargs": {"x": "\ud800"}}, 400,
         "chat_template_kwargs"),
    case("lone surrogate", TOK, {"prompt": "\ud800"}, 400, "prompt"),
    # malformed JSON
    case("malformed JSON", C, b'{"prompt": ', 400, None, ("JSON",)),
    case("malformed JSON", C, b'{"prompt": "Hi",}', 400, None, ("JSON",)),
    case("malformed JSON", C, b"NaN", 400),
    case("malformed JSON", C, b"[" * 30000 + b"]" * 30000, 400),  # nested beyond the parser's recursion limit
    case("malformed JSON", CH, b'{"messages": [}', 400, None, ("JSON",)),
    # chat templates are the server's: a client may not run its own
    case("client template", CH, {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}}, 400,
         "chat_template_kwargs"),
    case("client template", CH, {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "messages"),
    case("client template", TOK, {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}}, 400,
         "chat_template_kwargs"),
]


@pytest.mark.parametrize("group, path, body, status, param, words", MATRIX)
def test_endpoint_matrix(http, group, path, body, status, param, words):
    count(f"server: {group}")
    start = time.monotonic()
    response = http.post(path, content=body_of(body), headers={"Content-Type": J})
    assert time.monotonic() - start < 10
    if status == 200:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert_error(response, status, param, words=words)


@pytest.mark.parametrize("text", ODD_TEXT, ids=repr)
def test_odd_unicode_is_served(http, text):
    count("server: odd Unicode")
    """NUL, bidi controls, emoji sequences, BOM, combining marks, noncharacters, special-token look-alikes and
    template-looking text are ordinary text: in prompts, messages and stop strings they are served."""
    for path, body in [(C, {"prompt": text + " hi", "stop": [text], "max_tokens": 3, "echo": True}),
                       (CH, {"messages": [{"role": "user", "content": text, "name": text}], "stop": text,
                             "max_tokens": 3}),
                       (TOK, {"prompt": text}),
                       (C, {"prompt": text, "max_tokens": 3, "stream": True, "logprobs": 2})]:
        response = http.post(path, json=body)
        assert response.status_code == 200, (path, response.text)
        if path == C and body.get("echo"):
            assert response.json()["choices"][0]["text"].startswith(text)


def test_body_beyond_the_size_limit_is_413(http):
    big = json.dumps({"prompt": "x" * BODY_LIMIT, "max_tokens": 1}).encode()
    assert_error(http.post(C, content=big, headers={"Content-Type": J}), 413, words=(str(BODY_LIMIT),))
    chunks = iter([big[i:i + 8192] for i in range(0, len(big), 8192)])  # chunked: no Content-Length
    assert_error(http.post(C, content=chunks, headers={"Content-Type": J}), 413)
    # just under the limit is read (and refused for what it is: a prompt too long for max_model_len)
    under = json.dumps({"prompt": "x" * (BODY_LIMIT - 100), "max_tokens": 1}).encode()
    assert_error(http.post(C, content=under, headers={"Content-Type": J}), 400, "prompt")


def test_wrong_method_content_type_and_path(http):
    assert_error(http.get(C), 405)
    assert_error(http.put(CH, json={"messages": CHAT}), 405)
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.post(C, content=b'{"prompt": "Hi"}', headers={"Content-Type": "text/plain"}), 400)
    utf16 = http.post(C, content='{"prompt": "Hi", "max_tokens": 1}'.encode("utf-16"), headers={"Content-Type": J})
    assert utf16.status_code < 500  # JSON may come as UTF-16 (json.loads detects it): served or refused, no 500


# -- fuzzing ------------------------------------------------------------------------------------------------------
_odd_numbers = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 2**63, -(2**63),
                                2**64 + 1, 10**30, -1, 0, 1, 2])
_odd_text = st.one_of(st.sampled_from(ODD_TEXT + LONE_SURROGATES + ["", " ", "Hi", "tiny", "x" * 3000]),
                      st.text(max_size=6))
_scalars = st.one_of(st.none(), st.booleans(), _odd_numbers, st.integers(-3, 400), st.floats(), _odd_text)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(_odd_text, inner, max_size=3), max_leaves=6)
_fields = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "n", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs", "prompt_logprobs", "echo",
           "stream", "stream_options", "min_tokens", "ignore_eos", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "include_stop_str_in_output", "skip_special_tokens", "chat_template_kwargs",
           "add_generation_prompt", "tokens", "add_special_tokens", "user", "best_of", "logit_bias", "suffix",
           "response_format", "tools", "tool_choice", "detokenize"]
_message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), _odd_text)},
                                 optional={"content": _values, "name": _odd_text})


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from([C, CH, TOK, DETOK]),
       body=st.dictionaries(st.sampled_from(_fields), _values, max_size=5),
       prompt=st.one_of(st.none(), _odd_text, st.lists(st.one_of(st.integers(-3, 400), _odd_numbers), max_size=4)),
       messages=st.one_of(st.none(), st.lists(_message, max_size=2)),
       corrupt=st.one_of(st.none(), st.integers(0, 10**6)))
def test_fuzzed_bodies_never_give_500_nor_hang(http, path, body, prompt, messages, corrupt):
    count("server: fuzzed bodies")
    if prompt is not None:
        body.setdefault("prompt", prompt)
    if messages is not None:
        body.setdefault("messages", messages)
    # small generations where a body happens to be valid: the test is about input, not about generation
    for key in ("max_tokens", "max_completion_tokens"):
        if not isinstance(body.get(key), int) or isinstance(body.get(key), bool) or body[key] > 2:
            body[key] = 2
    content = json.dumps(body).encode()
    if corrupt is not None:  # one byte replaced: broken JSON or broken UTF-8
        at = corrupt % len(content)
        content = content[:at] + bytes([0x80 + corrupt % 0x80]) + content[at + 1:]
    start = time.monotonic()
    response = http.post(path, content=content, headers={"Content-Type": J})
    assert time.monotonic() - start < 15, "too slow: a hang?"
    assert response.status_code < 500, (content[:300], response.text[:300])
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    elif body.get("stream") is True and path in (C, CH):
        assert response.text.rstrip().endswith("data: [DONE]")


def test_the_server_is_healthy_and_idle_after_all_of_it(http, server):
    """Last in the module: after the matrix and the fuzzing, nothing is running or held, and it still serves."""
    assert http.get("/health").status_code == 200
    assert wait_for(lambda: (m := metric_values(server.url))["nanovllm:num_requests_running"] == 0
                    and m["nanovllm:num_requests_waiting"] == 0 and m["nanovllm:kv_cache_usage_perc"] == 0)
    response = http.post(C, json={"prompt": "Still there?", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    print("\nbad input:", json.dumps(TALLY, indent=1))
