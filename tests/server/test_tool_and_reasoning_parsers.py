"""The tool-call and reasoning parsers on text alone: streamed pieces add up to the whole answer."""

from __future__ import annotations

import json

import pytest

from nanovllm.server.chat_output import ChatChoiceOutput
from nanovllm.server.reasoning import ReasoningSplitter
from nanovllm.server.tools import ToolError, ToolPlan, messages_for_template, plan_tools

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}


def streamed(output: ChatChoiceOutput, text: str, step: int = 1) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, [(name, arguments)]) assembled from deltas of every ``step`` characters."""
    reasoning, content, calls, start = "", "", {}, 0
    for end in list(range(step, len(text), step)) + [len(text)]:
        delta = output.delta(text[start:end], final=end == len(text))
        start = end
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call.get("function", {}).get("name", "") if "id" in call else ""
            entry[1] += call.get("function", {}).get("arguments", "")
    return reasoning, content, [tuple(c) for c in calls.values()]


def whole(plan: ToolPlan, text: str, reasoning: ReasoningSplitter | None = None) -> dict:
    return ChatChoiceOutput(plan, reasoning).message(text)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_streamed_and_whole(step):
    plan = plan_tools([TOOL], "auto", None, "hermes", True)
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "f", ' \
           '"arguments": {"x": 2}}</tool_call>'
    message = whole(plan, text)
    assert message["content"] == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("f", {"x": 1}), ("f", {"x": 2})]
    _, content, calls = streamed(ChatChoiceOutput(plan), text, step)
    assert content == "Sure." and [(n, json.loads(a)) for n, a in calls] == [("f", {"x": 1}), ("f", {"x": 2})]


def test_hermes_without_calls_is_content():
    plan = plan_tools([TOOL], "auto", None, "hermes", True)
    assert whole(plan, "Just text <tool") == {"role": "assistant", "content": "Just text <tool"}
    assert streamed(ChatChoiceOutput(plan), "Just text <tool")[1] == "Just text <tool"


def test_llama3_json_calls():
    plan = plan_tools([TOOL], "auto", None, "llama3_json", True)
    message = whole(plan, '<|python_tag|>{"name": "f", "parameters": {"x": 3}}; {"name": "f", "parameters": {"x": 4}}')
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"x": 3}, {"x": 4}]
    assert whole(plan, "Hello there")["content"] == "Hello there"
    assert whole(plan, "{not json")["content"] == "{not json"


@pytest.mark.parametrize("step", [1, 7])
def test_required_and_named_stream_like_the_whole(step):
    required = plan_tools([TOOL], "required", None, None, False)
    assert required.structured_outputs.json["minItems"] == 1
    text = '[{"name": "f", "parameters": {"x": 5}}, {"name": "f", "parameters": {"x": 6}}]'
    message = whole(required, text)
    assert message["content"] is None and len(message["tool_calls"]) == 2
    assert streamed(ChatChoiceOutput(required), text, step)[2] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    named = plan_tools([TOOL], {"type": "function", "function": {"name": "f"}}, None, None, False)
    assert named.structured_outputs.json == TOOL["function"]["parameters"]
    assert streamed(ChatChoiceOutput(named), '{"x": 7}', step)[2] == [("f", '{"x": 7}')]
    assert plan_tools([TOOL], "required", False, None, False).structured_outputs.json["maxItems"] == 1


def test_tool_plan_errors_name_the_field():
    cases = [([{"type": "function"}], None, "tools"), ([TOOL, TOOL], None, "tools"), (None, "required", "tool_choice"),
             ([TOOL], "auto", "tool_choice"), ([TOOL], {"type": "function", "function": {"name": "g"}}, "tool_choice"),
             ([TOOL], "sometimes", "tool_choice")]
    for tools, choice, param in cases:
        with pytest.raises(ToolError) as e:
            plan_tools(tools, choice, None, None, False)
        assert e.value.param == param
    assert plan_tools([TOOL], None, None, None, False).mode == "none"  # no parser: tools shown, text kept
    assert plan_tools([TOOL], None, None, "hermes", True).mode == "auto"


def test_history_arguments_become_objects_for_the_template():
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    assert messages_for_template(history)[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_reasoning_split_streamed_and_whole(step):
    qwen3_open = ReasoningSplitter.for_prompt("qwen3", "<|im_start|>assistant\n<think>\n")
    qwen3_closed = ReasoningSplitter.for_prompt("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plan = ToolPlan()
    text = "let me see</think>The answer."
    assert whole(plan, text, qwen3_open) == {"role": "assistant", "content": "The answer.",
                                             "reasoning_content": "let me see"}
    assert streamed(ChatChoiceOutput(plan, qwen3_open), text, step)[:2] == ("let me see", "The answer.")
    assert whole(plan, "plain", qwen3_closed) == {"role": "assistant", "content": "plain", "reasoning_content": None}
    text = "<think>hmm</think>ok"
    assert streamed(ChatChoiceOutput(plan, qwen3_closed), text, step)[:2] == ("hmm", "ok")
    r1 = ReasoningSplitter("deepseek_r1")
    assert streamed(ChatChoiceOutput(plan, r1), "still thinking", step)[:2] == ("still thinking", "")
    assert whole(plan, "<think>a</think>b", r1)["reasoning_content"] == "a"
