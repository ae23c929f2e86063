"""The OpenAI API's request bodies (pydantic), their mapping onto SamplingParams, and the error shape."""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status_code: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or ("server_error" if status_code >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# -- request bodies ---------------------------------------------------------------------------------------------
# Fields are typed strictly where OpenAI is: a boolean is true or false (not 1 or "yes"), a number is not a string,
# and a token id is an integer, never a boolean (JSON's true would otherwise pass as the id 1).
# The roles OpenAI's chat API knows; any other is refused, as there.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class OpenAIModel(BaseModel):
    # Extra fields are kept, not dropped: vLLM-style sampling extras (top_k, min_p, ignore_eos, ...) arrive
    # that way and are matched against SamplingParams' fields; anything else is refused (see sampling_params()).
    model_config = ConfigDict(extra="allow")


class RequestBody(OpenAIModel):
    """A whole request body: every string in it, at any depth, must be valid Unicode text.

    JSON may spell a lone UTF-16 surrogate ("\\ud800"), which Python keeps in a str but nothing can encode as
    UTF-8: tokenizers refuse it and a response echoing it could not be written. Such a body is refused up front,
    with a 400 naming where the surrogate is (the APIError passes through pydantic to the app's handler).
    """

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = lone_surrogate_at(data)
        if found is not None:
            where, field = found
            raise bad_request(f"{where} is not valid Unicode text: it holds a lone surrogate (U+D800..U+DFFF); "
                              "send UTF-8 text.", param=field)
        return data


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_at(data: Any) -> tuple[str, str | None] | None:
    """(where, top-level field) of the first string in parsed JSON that holds a lone surrogate; None if none does.

    ``where`` reads like ``messages[0].content``. Iterative, so a deeply nested body cannot exhaust the stack.
    """
    stack: list[tuple[str, str | None, Any]] = [("", None, data)]
    while stack:
        path, field, value = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path or "the body", field
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not _is_unicode(key):
                    return (f"a key of {path}" if path else "a field name"), field
                stack.append((f"{path}.{key}" if path else str(key), field or str(key), item))
        elif isinstance(value, list):  # (numbers, e.g. a prompt's token ids, need no path)
            stack.extend((f"{path}[{i}]", field, item) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))
    return None


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    n: StrictInt | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, float] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extension: also answer the token ids, the prompt's and the generated ones (streamed: each chunk's
    # new ids, so a client can count tokens even where their text is empty, as with a model without tokenizer)
    return_token_ids: StrictBool = False
    # vLLM's extra body field: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None


class ChatMessage(OpenAIModel):
    role: Role
    content: str | list[dict[str, Any]] | None = None
    # an assistant's calls ({"id", "type": "function", "function": {"name", "arguments"}}), a tool's answer
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # accepted and ignored: they do not change what is generated
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[StrictInt]


# -- request -> SamplingParams ----------------------------------------------------------------------------------
# Fields of the bodies that are not sampling settings.
_NOT_SAMPLING = {"model", "prompt", "messages", "stream", "stream_options", "user", "echo", "add_generation_prompt",
                 "chat_template_kwargs", "parallel_tool_calls", "metadata", "store", "service_tier",
                 "max_completion_tokens", "top_logprobs", "logprobs", "return_token_ids", "response_format"}
# Read by the chat endpoint (server/tools.py); elsewhere they ask for what is not served.
_CHAT_ONLY = {"tools", "tool_choice"}
# Declared OpenAI fields that, at these values, ask for nothing: fine even where SamplingParams lacks them.
_NEUTRAL = {"top_p": 1.0, "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "best_of": 1,
            "seed": None, "stop": None, "logit_bias": None, "suffix": None, "tools": None, "tool_choice": "none",
            "response_format": None}


def _is_neutral(name: str, value) -> bool:
    if value is None or value == [] or value == {} or value == "":
        return True
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name == "tool_choice":
        return value in ("none", "auto")
    return name in _NEUTRAL and value == _NEUTRAL[name]


def sampling_params(body: SamplingRequest, num_prompt_tokens: int, max_model_len: int,
                    constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams of a request: every body field (declared or extra) named like a SamplingParams field.

    max_tokens defaults to what is left of max_model_len. A body field that SamplingParams does not have is
    refused with a 400 unless its value asks for nothing (top_p=1, n=1, ...), so no setting is silently ignored.
    constraint: the structured output that response_format or a forced tool call asks for.
    """
    supported = {f.name for f in dataclasses.fields(SamplingParams)}
    given = body.model_dump(exclude_unset=True)
    values: dict[str, Any] = {}
    chat = isinstance(body, ChatCompletionRequest)
    for name, value in given.items():
        if name in _NOT_SAMPLING or (chat and name in _CHAT_ONLY):
            continue
        if name in supported:
            if value is not None:
                values[name] = value
        elif not _is_neutral(name, value):
            declared = name in type(body).model_fields
            raise bad_request(f"{name!r} is not supported by this server" if declared
                              else f"unrecognized request argument supplied: {name!r}", param=name)

    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    max_tokens = given.get("max_completion_tokens") if isinstance(body, ChatCompletionRequest) else None
    max_tokens = max_tokens if max_tokens is not None else given.get("max_tokens")
    _logprobs_into(body, values, supported)

    room = max_model_len - num_prompt_tokens
    if num_prompt_tokens >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                          f"{num_prompt_tokens} tokens: it must be shorter, leaving room for at least one "
                          "generated token.", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room
    elif isinstance(max_tokens, int) and max_tokens > room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                          f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                          param="max_tokens", code="context_length_exceeded")
    values["max_tokens"] = max_tokens
    if constraint is not None:
        if values.get("structured_outputs") is not None:
            raise bad_request("structured_outputs cannot be combined with a response_format or a forced tool call.",
                              param="structured_outputs")
        values["structured_outputs"] = constraint

    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param=param_named_in(str(e), values)) from None


def response_format_constraint(response_format: dict | None) -> StructuredOutputsParams | None:
    """The structured output of OpenAI's response_format: text (none), json_object, or json_schema."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request('response_format "json_schema" needs {"json_schema": {"name": ..., "schema": {...}}}, '
                              f"got {spec!r}.", param="response_format")
        return StructuredOutputsParams(json=schema)
    raise bad_request(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}.',
                      param="response_format")


def param_named_in(message: str, names) -> str | None:
    """The field an engine error is about: the one its message starts with ("top_p must be ...")."""
    for name in sorted(names, key=len, reverse=True):
        if re.match(rf"{re.escape(name)}\b", message):
            return name
    return None


def _logprobs_into(body: SamplingRequest, values: dict, supported: set[str]) -> None:
    """OpenAI's logprobs (an int for completions; a bool plus top_logprobs for chat) as SamplingParams.logprobs."""
    if isinstance(body, ChatCompletionRequest):
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:  # named as sent, not as SamplingParams calls it
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}.", param="top_logprobs")
        wanted = (top or 0) if body.logprobs else None
        if top is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true.", param="top_logprobs")
    else:
        wanted = body.logprobs
    if wanted is None:
        return
    if "logprobs" not in supported:
        raise bad_request("'logprobs' is not supported by this server", param="logprobs")
    if wanted < 0:
        raise bad_request(f"logprobs must be non-negative, got {wanted}.", param="logprobs")
    values["logprobs"] = wanted


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them: content as one string (text parts joined by newlines)."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}]: only text content parts are supported, got "
                                      f"{part.get('type')!r}.", param="messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        entry = {k: v for k, v in (message.model_extra or {}).items()}
        entry.update({k: getattr(message, k) for k in ("tool_calls", "tool_call_id", "name")
                      if getattr(message, k) is not None})
        entry.update(role=message.role, content=content)
        out.append(entry)
    return out


# -- responses --------------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _logprob(value) -> float:
    return float(getattr(value, "logprob", value))  # a Logprob, or a bare float


def _token_text(tokenizer, token_id: int, value=None) -> str:
    text = getattr(value, "decoded_token", None)
    if text is not None:
        return text
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _ranked(entry: dict, top: int) -> list[tuple[int, object]]:
    return sorted(entry.items(), key=lambda kv: _logprob(kv[1]), reverse=True)[:top]


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict] | None, top: int,
                        text_offset: int = 0) -> dict | None:
    """The legacy completions ``logprobs`` object of some generated tokens ({token id: logprob} each)."""
    if logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        text = _token_text(tokenizer, token_id, entry.get(token_id))
        tokens.append(text)
        token_logprobs.append(_logprob(entry[token_id]) if token_id in entry else None)
        top_logprobs.append({_token_text(tokenizer, t, v): _logprob(v) for t, v in _ranked(entry, top)}
                            if top else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict] | None, top: int) -> dict | None:
    """The chat ``logprobs`` object (``{"content": [...]}``) of some generated tokens."""
    if logprobs is None:
        return None

    def one(token_id: int, value) -> dict:
        text = _token_text(tokenizer, token_id, value)
        return {"token": text, "logprob": _logprob(value), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        item = one(token_id, entry.get(token_id, float("-inf")))
        item["top_logprobs"] = [one(t, v) for t, v in _ranked(entry, top)]
        content.append(item)
    return {"content": content}


def prompt_logprobs(tokenizer, entries: list[dict | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": _logprob(v), "rank": getattr(v, "rank", None),
                      "decoded_token": _token_text(tokenizer, t, v)} for t, v in entry.items()}
            for entry in entries]
