"""The published schema of the HTTP API: response bodies, streamed chunks and OpenAI's error shape per route.

These models only document what the handlers write (they are declared with ``responses=``, so nothing is
re-validated on the way out); generated clients and schema-driven tests read them from ``/openapi.json``.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict


class Published(BaseModel):
    # additionalProperties: false, so a field the handlers write but the schema lacks fails schema-driven checks
    model_config = ConfigDict(extra="forbid")


# -- errors -----------------------------------------------------------------------------------------------------
class ErrorDetail(Published):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(Published):
    error: ErrorDetail


ERROR_DESCRIPTIONS = {
    400: "invalid request (the error's param names the field)",
    401: "missing or wrong API key (servers started with --api-key)",
    404: "unknown model, or no such path",
    413: "request body over --max-request-body-bytes",
    429: "too many requests waiting (--max-queued-requests); retry after Retry-After seconds",
    503: "the engine is not running, or the server is shutting down",
}


# -- shared parts ------------------------------------------------------------------------------------------------
class PromptTokensDetails(Published):
    cached_tokens: int


class Usage(Published):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Published):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Published):
    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token None (the first) or {token id: its logprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# -- /v1/completions ---------------------------------------------------------------------------------------------
class CompletionChoice(Published):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    token_ids: list[int] | None = None  # return_token_ids


class Completion(Published):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Published):
    """One ``data:`` event of a streamed completion; the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # stream_options.include_usage: null in each chunk, then a last chunk with it


# -- /v1/chat/completions ----------------------------------------------------------------------------------------
class TopLogprob(Published):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Published):
    content: list[TokenLogprob]


class FunctionCall(Published):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Published):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(Published):
    role: Literal["assistant"]
    content: str | None  # None when the reply is only tool calls
    reasoning_content: str | None = None  # with --reasoning-parser: the text inside the model's <think>
    tool_calls: list[ToolCall] | None = None  # with tools: the calls the reply makes


class ChatChoice(Published):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletion(Published):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class FunctionCallDelta(Published):
    name: str | None = None
    arguments: str | None = None  # the call's arguments as they stream: the deltas add up to its JSON text


class ToolCallDelta(Published):
    """A tool call as it streams: the first delta of a call has its id, type and name, later ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(Published):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Published):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionChunk(Published):
    """One ``data:`` event of a streamed chat completion; the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


# -- the small endpoints -----------------------------------------------------------------------------------------
class ModelCard(Published):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(Published):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(Published):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Published):
    prompt: str


# -- per-route declarations --------------------------------------------------------------------------------------
def _errors(statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


AUTH = (401,)  # every route but /health and /metrics, when the server has an API key
BODY = (400, 401, 404, 413, 503)  # routes that read a body naming a model
GENERATE = (*BODY, 429)  # routes that queue engine requests


def responses(ok: type[BaseModel] | None, statuses: tuple[int, ...], stream: type[BaseModel] | None = None,
              ok_description: str = "Successful Response") -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: its 200 body (and, with ``stream``, its text/event-stream of chunks), and its
    errors in OpenAI's shape."""
    out: dict[int | str, dict[str, Any]] = _errors(statuses)
    if ok is not None:
        out[200] = {"model": ok, "description": ok_description}
    if stream is not None:
        out[200]["content"] = {"text/event-stream": {"schema": {
            "type": "string",
            "description": f"with \"stream\": true, server-sent events: each `data:` line holds a "
                           f"{stream.__name__} as JSON (an error object if generation fails midway), the last "
                           "one is `data: [DONE]`"}}}
        out[200]["description"] = (f"{ok.__name__} as JSON; with \"stream\": true, a text/event-stream of "
                                   f"{stream.__name__} events")
    return out


HEALTH = {200: {"description": "the engine is running (an empty body)", "content": {}},
          503: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[503]}}
METRICS = {200: {"description": "Prometheus metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}}


def publish_schema(app: FastAPI, extra_models: tuple[type[BaseModel], ...] = (CompletionChunk,
                                                                               ChatCompletionChunk)) -> None:
    """Let ``app.openapi()`` also carry the streamed chunk models (no route returns them as JSON), and drop
    FastAPI's 422 where a route declares our 400 (invalid bodies are answered 400, in OpenAI's shape)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in extra_models:
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                answers = operation.get("responses", {})
                if "400" in answers:
                    answers.pop("422", None)
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
