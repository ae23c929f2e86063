"""Tool calling: which tools a chat request offers, the grammar that forces a call, and reading calls back.

``tool_choice``: "none" (tools are shown to the template, nothing is parsed), "auto" (the model decides; its
text is read by the server's ``--tool-call-parser``, which needs ``--enable-auto-tool-choice``), "required" (a
JSON array of one or more ``{"name", "parameters"}`` calls, forced by a grammar) or a named function (its
arguments, a JSON object forced by the function's parameter schema). Forced calls parse and match their schemas
whatever the model, since only tokens the grammar allows can be sampled.

Parsers of the model's own call format (auto): ``hermes`` (Qwen2.5 / Qwen3 / Hermes: ``<tool_call>{"name",
"arguments"}</tool_call>``) and ``llama3_json`` (Llama 3.x: ``{"name", "parameters"}`` objects, ``;``-separated,
optionally after ``<|python_tag|>``).

``ToolCallStream`` turns an output's text (the whole text so far, each time) into OpenAI's content and
``tool_calls`` deltas; the non-streamed answer runs the same code once on the final text, so both agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.server.reasoning import held_back

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


class ToolError(ValueError):
    """A request's tools or tool_choice cannot be served; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tool_call_parser(name: str | None, enable_auto_tool_choice: bool) -> None:
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of {list(TOOL_CALL_PARSERS)}.")
    if enable_auto_tool_choice and name is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{list(TOOL_CALL_PARSERS)}).")


@dataclass
class ToolPlan:
    """What a chat request asks of tools: the template's tools, the forced grammar, how to read the output."""

    tools: list[dict] | None = None  # for apply_chat_template(tools=...)
    mode: str = "none"  # none | auto | required | named
    function: str | None = None  # the named function
    parser: str | None = None  # auto: the tool-call parser
    structured_outputs: StructuredOutputsParams | None = None  # required / named: the calls' grammar

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


def _function_of(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}, got {tool!r}.", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function must be an object with a name, got {function!r}.", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.function.name must be a non-empty string, got {name!r}.", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema (an object), got {parameters!r}.",
                        "tools")
    return function


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def plan_tools(tools: list | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None,
               parser: str | None, enable_auto_tool_choice: bool) -> ToolPlan:
    """Check a request's tools and tool_choice (ToolError naming the field) and say what to do."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError(f"tool_choice {tool_choice!r} needs tools.", "tool_choice")
        return ToolPlan()
    if not isinstance(tools, list):
        raise ToolError(f"tools must be a list, got {tools!r}.", "tools")
    functions = [_function_of(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError(f"tools has functions of the same name: {names}.", "tools")
    template_tools = [{"type": "function", "function": f} for f in functions]
    auto = enable_auto_tool_choice and parser is not None
    if tool_choice is None:
        tool_choice = "auto" if auto else "none"  # without a parser the text is left as it is
    if tool_choice == "none":
        return ToolPlan(template_tools)
    if tool_choice == "auto":
        if not auto:
            raise ToolError('tool_choice "auto" needs the server to run with --enable-auto-tool-choice and '
                            "--tool-call-parser.", "tool_choice")
        return ToolPlan(template_tools, "auto", parser=parser)
    if tool_choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                              "parameters": _parameters(f)},
             "required": ["name", "parameters"], "additionalProperties": False} for f in functions]}}
        if parallel_tool_calls is False:
            calls["maxItems"] = 1
        return ToolPlan(template_tools, "required", structured_outputs=StructuredOutputsParams(json=calls))
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolError(f'a named tool_choice is {{"type": "function", "function": {{"name": ...}}}}, got '
                            f"{tool_choice!r}.", "tool_choice")
        if name not in names:
            raise ToolError(f"tool_choice names function {name!r}, which is not in tools ({names}).", "tool_choice")
        function = functions[names.index(name)]
        return ToolPlan(template_tools, "named", function=name,
                        structured_outputs=StructuredOutputsParams(json=_parameters(function)))
    raise ToolError(f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}.',
                    "tool_choice")


def messages_for_template(messages: list[dict]) -> list[dict]:
    """History messages as chat templates read them: an assistant's tool-call arguments as objects (templates
    render them with ``tojson``; OpenAI sends them as JSON text)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = dict(message, tool_calls=[_call_for_template(c) for c in calls])
        out.append(message)
    return out


def _call_for_template(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            pass  # left as the text it was
    # Qwen's and Llama's templates read name/arguments from the call itself or from its "function"
    return dict(call, function=function)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallStream:
    """One choice's text -> content and tool-call deltas. ``update(text, final)`` takes the whole text so far."""

    plan: ToolPlan
    calls: list[dict] = field(default_factory=list)  # complete calls sent: {"id", "type", "function"}
    sent_content: int = 0  # characters of content sent
    sent_arguments: int = 0  # named: characters of the arguments sent
    _scan: int = 0  # required / hermes / llama3: where the next call's text starts

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(new content, new tool-call deltas in OpenAI's stream shape)."""
        mode = self.plan.mode
        if mode == "none":
            return self._content(text), []
        if mode == "named":
            return "", self._named(text)
        if mode == "required":
            return "", self._json_array(text, final)
        if self.plan.parser == "hermes":
            return self._hermes(text, final)
        return self._llama3(text, final)

    def _content(self, text: str) -> str:
        delta = text[self.sent_content:]
        self.sent_content = len(text)
        return delta

    def _named(self, text: str) -> list[dict]:
        deltas = []
        if not self.calls:
            call = {"id": new_call_id(), "type": "function", "function": {"name": self.plan.function,
                                                                           "arguments": ""}}
            self.calls.append(call)
            deltas.append({"index": 0, **call, "function": dict(call["function"])})
        new = text[self.sent_arguments:]
        self.sent_arguments = len(text)
        self.calls[0]["function"]["arguments"] = text
        if new:
            deltas.append({"index": 0, "function": {"arguments": new}})
        return deltas

    def _add_call(self, name: str, arguments: Any) -> dict:
        call = {"id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                             else json.dumps(arguments, ensure_ascii=False)}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call}

    def _json_array(self, text: str, final: bool) -> list[dict]:
        """required: the complete objects of a JSON array [{"name", "parameters"}, ...] not sent yet."""
        decoder, deltas = json.JSONDecoder(), []
        while True:
            at = self._scan
            while at < len(text) and text[at] in " \t\r\n[,":
                at += 1
            if at >= len(text) or text[at] != "{":
                return deltas
            try:
                value, end = decoder.raw_decode(text, at)
            except ValueError:
                return deltas  # not complete yet
            self._scan = end
            if isinstance(value, dict) and isinstance(value.get("name"), str):
                deltas.append(self._add_call(value["name"], value.get("parameters", value.get("arguments", {}))))

    def _hermes(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """Content up to the first <tool_call> streams as it comes; each <tool_call>...</tool_call> is a call."""
        opened = text.find(_HERMES_OPEN)
        if opened < 0:
            visible = text if final else text[:len(text) - held_back(text, _HERMES_OPEN)]
            return self._content(visible), []
        content = self._content(text[:opened]) if self.sent_content < opened else ""
        deltas = []
        at = max(self._scan, opened)
        while True:
            start = text.find(_HERMES_OPEN, at)
            if start < 0:
                break
            close = text.find(_HERMES_CLOSE, start)
            if close < 0 and not final:
                break
            body = text[start + len(_HERMES_OPEN):close if close >= 0 else len(text)]
            at = self._scan = close + len(_HERMES_CLOSE) if close >= 0 else len(text)
            call = _json_object(body)
            if call is not None and isinstance(call.get("name"), str):
                deltas.append(self._add_call(call["name"], call.get("arguments", call.get("parameters", {}))))
            if close < 0:
                break
        return content, deltas

    def _llama3(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """Calls when the text starts with a JSON object (or <|python_tag|>); else it is all content."""
        head = text.lstrip()
        if not head or (not final and _PYTHON_TAG.startswith(head)):
            return "", []  # undecided yet
        if not (head.startswith("{") or head.startswith(_PYTHON_TAG)):
            return self._content(text), []
        if not final:
            return "", []  # calls are read once the output is complete
        body = head[len(_PYTHON_TAG):] if head.startswith(_PYTHON_TAG) else head
        calls = [_json_object(part) for part in _split_calls(body)]
        if not calls or any(c is None or not isinstance(c.get("name"), str) for c in calls):
            return self._content(text), []  # not calls after all: the model's text as it is
        return "", [self._add_call(c["name"], c.get("parameters", c.get("arguments", {}))) for c in calls]


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _split_calls(body: str) -> list[str]:
    """JSON objects one after another, separated by ';' (or nothing but spaces)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
        if at >= len(body):
            break
        try:
            _, end = decoder.raw_decode(body, at)
        except ValueError:
            return [body[at:]]  # not JSON: the caller falls back to content
        parts.append(body[at:end])
        at = end
    return parts
