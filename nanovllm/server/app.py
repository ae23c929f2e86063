"""The OpenAI-compatible HTTP app: completions, chat, models, tokenize, health and metrics over an EngineClient.

Every failure a client can cause answers in OpenAI's error shape with a 4xx status; a client that disconnects
has its requests aborted at once (their KV blocks are freed before the engine's next step). A fault while the
engine processes one request fails that request alone (500, or an error event in a stream).

Limits (each refused with a 4xx that names it): the body size (413), requests in flight (429 with Retry-After),
``n`` (``max_n``), prompts in one completions request (``max_prompts_per_request``), and prompt + max_tokens
within max_model_len. Prompts are tokenized in a worker thread (tokenizers release the GIL), so a long one does
not stall other requests' streams, and text too long to fit max_model_len is refused before it is tokenized.

Streams send a chunk for each batch of new tokens, even one whose text is empty. vLLM's ``return_token_ids``
extension adds the ids: completions choices carry ``prompt_token_ids`` and ``token_ids`` (the generated ones);
chat answers carry ``prompt_token_ids`` beside ``choices`` and ``token_ids`` in each choice. Streamed, every
chunk's choices carry their new ``token_ids``, and ``prompt_token_ids`` comes once: in a completions choice's
first chunk, in the chat stream's first (role) chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.engine.async_engine import (
    EngineClient,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind
from nanovllm.server import openapi
from nanovllm.server.chat_output import ChatChoiceOutput
from nanovllm.server.defaults import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS_PER_REQUEST
from nanovllm.server.metrics import ServerMetrics
from nanovllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    chat_logprobs,
    completion_logprobs,
    message_dicts,
    now,
    param_named_in,
    prompt_logprobs,
    random_id,
    response_format_constraint,
    sampling_params,
    usage,
)
from nanovllm.server.reasoning import ReasoningSplitter, check_reasoning_parser
from nanovllm.server.tools import (
    ToolError,
    ToolPlan,
    check_tool_call_parser,
    messages_for_template,
    plan_tools,
)

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key
RETRY_AFTER_SECONDS = 1


def build_app(llm: EngineClient, *, served_model_names: list[str] | None = None, api_key: str | None = None,
              max_request_body_bytes: int | None = None, max_n: int | None = DEFAULT_MAX_N,
              max_prompts_per_request: int | None = DEFAULT_MAX_PROMPTS_PER_REQUEST, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None) -> FastAPI:
    """The app serving ``llm``; requests naming a model must use one of ``served_model_names``.

    api_key: when set, every path but /health and /metrics needs ``Authorization: Bearer <api_key>``.
    max_request_body_bytes: larger bodies are refused with 413 (None: no limit).
    max_n, max_prompts_per_request: larger ``n`` / more prompts in one completions request get 400 (None: no limit).
    tool_call_parser, enable_auto_tool_choice: how tool_choice "auto" reads the model's calls (server/tools.py).
    reasoning_parser: splits the reasoning off into ``reasoning_content`` (server/reasoning.py).
    """
    check_tool_call_parser(tool_call_parser, enable_auto_tool_choice)
    check_reasoning_parser(reasoning_parser)
    server = OpenAIServer(llm, served_model_names or [llm.model_path], max_n=max_n,
                          max_prompts_per_request=max_prompts_per_request, tool_call_parser=tool_call_parser,
                          enable_auto_tool_choice=enable_auto_tool_choice, reasoning_parser=reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has drained the open connections (graceful shutdown): stop the engine loop
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="nanovllm", version=_version(), lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)
    if max_request_body_bytes is not None:
        app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    app.add_api_route("/health", server.health, methods=["GET"], response_class=Response, responses=openapi.HEALTH)
    app.add_api_route("/metrics", server.metrics_endpoint, methods=["GET"], response_class=Response,
                      responses=openapi.METRICS)
    app.add_api_route("/v1/models", server.models, methods=["GET"], response_model=None,
                      responses=openapi.responses(openapi.ModelList, openapi.AUTH))
    app.add_api_route("/v1/completions", server.completions, methods=["POST"],
                      responses=openapi.responses(openapi.Completion, openapi.GENERATE, openapi.CompletionChunk))
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"],
                      responses=openapi.responses(openapi.ChatCompletion, openapi.GENERATE,
                                                  openapi.ChatCompletionChunk))
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"], response_model=None,
                      responses=openapi.responses(openapi.TokenizeResponse, openapi.BODY))
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"], response_model=None,
                      responses=openapi.responses(openapi.DetokenizeResponse, openapi.BODY))
    openapi.publish_schema(app)  # response_model=None: the handlers' `-> dict` is not the documented body
    return app


def _version() -> str:
    from nanovllm import __version__
    return __version__


# -- errors -----------------------------------------------------------------------------------------------------
class _ASCIIJSONResponse(JSONResponse):
    """JSON escaped to ASCII: an error message may quote client text, whose encoding must never fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error_response(error: APIError) -> JSONResponse:
    return _ASCIIJSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return _error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return _error_response(APIError(503, str(exc), type="service_unavailable"))

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, exc: QueueFullError):
        return _error_response(APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)}))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return _error_response(APIError(500, f"internal server error: {type(exc).__name__}"))


def _validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the offending top-level field; a union field's several complaints are joined."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return bad_request(f"malformed JSON body: {detail}")

    def field(error) -> str | None:
        loc = [p for p in error.get("loc", ()) if p != "body"]
        return str(loc[0]) if loc else None

    param = field(first)
    same = [e for e in errors if field(e) == param]
    messages = list(dict.fromkeys(e.get("msg", "invalid value") for e in same))
    message = "; or ".join(messages[:3])
    if param is None:
        return bad_request(f"invalid request body: {message} (send a JSON object, with Content-Type: "
                           "application/json)")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return bad_request(f"invalid value for {where if len(same) == 1 else param}: {message}", param=param)


# -- middleware (plain ASGI, so streaming and disconnects pass through untouched) -----------------------------
class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` matches (compared in constant time); OPEN_PATHS stay open."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
        if not hmac.compare_digest(given, self.expected):
            error = APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await _error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a request body over ``max_bytes`` (by Content-Length, or counted as it streams in)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the limit of {self.max_bytes} bytes.",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await _error_response(self._too_large())(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises HTTPExceptions met while reading the body; our handler shapes it
                    raise StarletteHTTPException(413, self._too_large().message)
            return message

        return await self.app(scope, counting_receive, send)


# -- the endpoints ----------------------------------------------------------------------------------------------
class OpenAIServer:
    def __init__(self, llm: EngineClient, served_model_names: list[str], *, max_n: int | None = DEFAULT_MAX_N,
                 max_prompts_per_request: int | None = DEFAULT_MAX_PROMPTS_PER_REQUEST,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None):
        self.llm = llm
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser
        self.tokenizer = llm.tokenizer
        self.model_names = list(served_model_names)
        self.model_name = self.model_names[0]
        self.created = now()
        self.max_n = max_n
        self.max_prompts_per_request = max_prompts_per_request
        self.longest_token_chars = _longest_token_chars(self.tokenizer)
        self.metrics = ServerMetrics(self.model_name)
        llm.stats_listeners.append(self.metrics.record)

    # -- small endpoints --------------------------------------------------------------------------------------
    async def health(self) -> Response:
        if not self.llm.is_running:
            return _error_response(APIError(503, "the engine is not running.", type="service_unavailable"))
        if self.llm.draining:
            return _error_response(APIError(503, "the server is shutting down.", type="service_unavailable"))
        return Response(status_code=200)

    async def metrics_endpoint(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "nanovllm",
             "root": self.llm.model_path, "parent": None, "max_model_len": self.llm.max_model_len}
            for name in self.model_names]}

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'.")
        if body.messages is not None:
            tokens = await self._chat_prompt(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        else:
            self._need_tokenizer()
            self._check_text_length(len(body.prompt), "prompt")
            tokens = await asyncio.to_thread(self.tokenizer.encode, body.prompt,
                                             add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.llm.max_model_len, "tokens": tokens}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self._check_model(body.model)
        self._need_tokenizer()
        vocab_size = self.llm.vocab_size
        for t in body.tokens:
            if not 0 <= t < vocab_size:
                raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab_size}).", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    # -- completions ------------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self._check_model(body.model)
        self.llm.check_admission()
        prompts = await self._completion_prompts(body.prompt)
        constraint = response_format_constraint(body.response_format)
        params = [self._params(body, ids, constraint) for _, ids in prompts]
        await self._check_structured_outputs(params[0], "response_format" if constraint else None)
        request_id = random_id("cmpl")
        job = _Job(self.llm, raw, request_id,
                   [{"prompt": text, "prompt_token_ids": ids} for text, ids in prompts], params).start()
        if body.stream:
            return _EventStream(self._stream_completion(body, job, prompts))
        finals = await job.finals()
        if finals is None:
            return Response(status_code=499)  # the client left; nobody reads this
        n = _n(params[0])
        choices, completion_tokens = [], 0
        for i, output in enumerate(finals):
            text, _ = prompts[i]
            for c in output.outputs:
                completion_tokens += len(c.token_ids)
                prefix = (text if text is not None else self._decode(output.prompt_token_ids)) if body.echo else ""
                choices.append({
                    "index": i * n + c.index, "text": prefix + c.text,
                    "logprobs": completion_logprobs(self.tokenizer, c.token_ids, c.logprobs, body.logprobs or 0,
                                                    len(prefix)),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    **_prompt_logprobs_field(self.tokenizer, output),
                    **({"prompt_token_ids": list(output.prompt_token_ids), "token_ids": list(c.token_ids)}
                       if body.return_token_ids else {})})
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        cached = sum(o.num_cached_tokens for o in finals)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": now(),
                             "model": self.model_name, "choices": choices,
                             "usage": usage(prompt_tokens, completion_tokens, cached)})

    async def _stream_completion(self, body: CompletionRequest, job: _Job,
                                 prompts: list[tuple[str | None, list[int]]]) -> AsyncIterator[str]:
        created = now()
        n = _n(job.params[0])
        progress = _Progress()
        echoed: set[int] = set()
        started: set[int] = set()  # choices that have had a chunk (the first one carries prompt_token_ids)

        def chunk(choices: list[dict], **extra) -> str:
            return _event({"id": job.request_id, "object": "text_completion", "created": created,
                           "model": self.model_name, "choices": choices, **extra,
                           **({"usage": None} if body.include_usage and "usage" not in extra else {})})

        fast = _ChunkTemplate(job.request_id, "text_completion", created, self.model_name, body.include_usage,
                              body.return_token_ids)
        async for i, output in job.outputs():
            for c in output.outputs:
                index = i * n + c.index
                delta, new_ids, new_logprobs, finish = progress.advance(index, c)
                if body.echo and index not in echoed:
                    echoed.add(index)
                    text, _ = prompts[i]
                    delta = (text if text is not None else self._decode(output.prompt_token_ids)) + delta
                # a chunk per batch of new tokens, even when their text is empty (held back for a stop string,
                # or a model without tokenizer), so a client sees every token arrive
                if not delta and not new_ids and not finish:
                    continue
                logprobs = completion_logprobs(self.tokenizer, new_ids, new_logprobs, body.logprobs or 0)
                if logprobs is None and not finish and (index in started or not body.return_token_ids):
                    yield fast.completion(index, delta, new_ids)  # the common chunk, without a dict
                    continue
                choice = {"index": index, "text": delta, "logprobs": logprobs,
                          "finish_reason": c.finish_reason if finish else None,
                          "stop_reason": c.stop_reason if finish else None}
                if body.return_token_ids:
                    choice["token_ids"] = new_ids
                    if index not in started:
                        choice["prompt_token_ids"] = list(output.prompt_token_ids)
                started.add(index)
                yield chunk([choice])
        if job.error is not None:
            yield _event(job.error.body())
        elif body.include_usage and not job.disconnected:
            yield chunk([], usage=usage(job.num_prompt_tokens, progress.num_tokens))
        yield "data: [DONE]\n\n"

    # -- chat -------------------------------------------------------------------------------------------------
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(body.model)
        self.llm.check_admission()
        plan = self._tool_plan(body)
        if plan.structured_outputs is not None and response_format_constraint(body.response_format) is not None:
            raise bad_request(f"response_format cannot be combined with tool_choice {body.tool_choice!r}.",
                              param="response_format")
        ids = await self._chat_prompt(body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                                      tools=plan.tools)
        from_format = response_format_constraint(body.response_format)
        params = self._params(body, ids, plan.structured_outputs or from_format)
        await self._check_structured_outputs(params, "tools" if plan.structured_outputs is not None
                                             else "response_format" if from_format is not None else None)
        outputs = [self._chat_choice_output(plan, ids) for _ in range(_n(params))]
        request_id = random_id("chatcmpl")
        job = _Job(self.llm, raw, request_id, [{"prompt_token_ids": ids}], [params]).start()
        top = body.top_logprobs or 0
        if body.stream:
            return _EventStream(self._stream_chat(body, job, top, outputs))
        finals = await job.finals()
        if finals is None:
            return Response(status_code=499)
        (output,) = finals
        choices = [{"index": c.index, "message": outputs[c.index].message(c.text),
                    "logprobs": chat_logprobs(self.tokenizer, c.token_ids, c.logprobs, top),
                    "finish_reason": outputs[c.index].finish_reason(c.finish_reason), "stop_reason": c.stop_reason,
                    **({"token_ids": list(c.token_ids)} if body.return_token_ids else {})}
                   for c in output.outputs]
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": now(),
                             "model": self.model_name, "choices": choices,
                             "usage": usage(len(output.prompt_token_ids), completion_tokens, output.num_cached_tokens),
                             **_prompt_logprobs_field(self.tokenizer, output),
                             **({"prompt_token_ids": list(output.prompt_token_ids)} if body.return_token_ids else {})})

    async def _stream_chat(self, body: ChatCompletionRequest, job: _Job, top: int,
                           outputs: list[ChatChoiceOutput]) -> AsyncIterator[str]:
        created = now()
        progress = _Progress()

        def chunk(choices: list[dict], **extra) -> str:
            return _event({"id": job.request_id, "object": "chat.completion.chunk", "created": created,
                           "model": self.model_name, "choices": choices, **extra,
                           **({"usage": None} if body.include_usage and "usage" not in extra else {})})

        fast = _ChunkTemplate(job.request_id, "chat.completion.chunk", created, self.model_name, body.include_usage,
                              body.return_token_ids)
        # the role first, for every choice, before any token is ready
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None, **({"token_ids": []} if body.return_token_ids else {})}
                     for i in range(_n(job.params[0]))],
                    **({"prompt_token_ids": job.prompts[0]["prompt_token_ids"]} if body.return_token_ids else {}))
        async for _, output in job.outputs():
            for c in output.outputs:
                _, new_ids, new_logprobs, finish = progress.advance(c.index, c)
                # a chunk per batch of new tokens, even when their text is empty (held back for a stop string,
                # or a model without tokenizer), so a client sees every token arrive
                if not new_ids and not finish:
                    continue
                choice_output = outputs[c.index]
                delta = choice_output.delta(c.text, final=finish)
                logprobs = chat_logprobs(self.tokenizer, new_ids, new_logprobs, top)
                if logprobs is None and not finish:
                    yield fast.chat(c.index, delta, new_ids)  # the common chunk, without a dict
                    continue
                yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": choice_output.finish_reason(c.finish_reason) if finish else None,
                              "stop_reason": c.stop_reason if finish else None,
                              **({"token_ids": new_ids} if body.return_token_ids else {})}])
        if job.error is not None:
            yield _event(job.error.body())
        elif body.include_usage and not job.disconnected:
            yield chunk([], usage=usage(job.num_prompt_tokens, progress.num_tokens))
        yield "data: [DONE]\n\n"

    # -- helpers ----------------------------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist; this server has {self.model_names}.",
                           param="model", code="model_not_found")

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: give prompts as token ids.")

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, text with more characters than max_model_len tokens can hold."""
        longest = self.longest_token_chars
        if longest is not None and num_chars > longest * self.llm.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.llm.max_model_len} tokens, and no token "
                              f"is longer than {longest} characters, so {num_chars} characters of {param} cannot fit.",
                              param=param, code="context_length_exceeded")

    async def _completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) of each prompt: a string, token ids, or a list of either."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))):
            prompt = [prompt]
        if self.max_prompts_per_request is not None and len(prompt) > self.max_prompts_per_request:
            raise bad_request(f"{len(prompt)} prompts in one request; the limit is {self.max_prompts_per_request}.",
                              param="prompt")
        for p in prompt:
            if isinstance(p, str):
                self._check_text_length(len(p), "prompt")

        def tokenize_all() -> list[tuple[str | None, list[int]]]:
            out = []
            for i, p in enumerate(prompt):
                try:
                    out.append(self.llm.tokenize_prompt(p))
                except ValueError as e:
                    raise bad_request(f"prompt {i}: {e}" if len(prompt) > 1 else str(e), param="prompt") from None
            return out

        return await asyncio.to_thread(tokenize_all)

    async def _chat_prompt(self, messages, add_generation_prompt: bool,
                           chat_template_kwargs: dict | None, tools: list[dict] | None = None) -> list[int]:
        conversation = messages_for_template(message_dicts(messages))
        if chat_template_kwargs and "chat_template" in chat_template_kwargs:
            # a template is code (Jinja, sandboxed or not): the server runs the model's own, never a client's
            raise bad_request("chat_template cannot be given in a request: the server uses the model's own.",
                              param="chat_template_kwargs")
        self._check_text_length(sum(_text_length(m) for m in conversation), "messages")
        if tools:
            chat_template_kwargs = dict(chat_template_kwargs or {}, tools=tools)

        def render() -> list[int]:
            try:
                return self.llm.apply_chat_template(conversation, add_generation_prompt, chat_template_kwargs)
            except Exception as e:  # the template ran on the client's messages and kwargs: their fault, not ours
                raise bad_request(f"cannot apply the chat template: {type(e).__name__}: {e}",
                                  param="messages") from None

        ids = await asyncio.to_thread(render)
        if not ids:
            raise bad_request("the chat template gave an empty prompt.", param="messages")
        return ids

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        try:
            return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_call_parser,
                              self.enable_auto_tool_choice)
        except ToolError as e:
            raise bad_request(str(e), param=e.param) from None

    def _chat_choice_output(self, plan: ToolPlan, prompt_ids: list[int]) -> ChatChoiceOutput:
        reasoning = None
        if self.reasoning_parser is not None:
            tail = self.tokenizer.decode(prompt_ids[-32:]) if self.tokenizer is not None else ""
            reasoning = ReasoningSplitter.for_prompt(self.reasoning_parser, tail)
        return ChatChoiceOutput(plan, reasoning)

    async def _check_structured_outputs(self, params, param: str | None = None) -> None:
        """A constraint that cannot compile is the client's 400, before any response starts (compiled in a
        worker thread; the engine's cache keeps it for the request)."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        try:
            await asyncio.to_thread(self.llm.check_structured_outputs, constraint)
        except ValueError as e:
            raise bad_request(str(e), param=param or "structured_outputs") from None

    def _params(self, body, token_ids: list[int], constraint=None):
        params = sampling_params(body, len(token_ids), self.llm.max_model_len, constraint)
        # a stream sends what is new each step; a plain answer needs the finished output only
        params.output_kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        if self.max_n is not None and params.n > self.max_n:
            raise bad_request(f"n must be at most {self.max_n} on this server, got {params.n}.", param="n")
        try:
            self.llm.validate_request(token_ids, params)
        except ValueError as e:  # e.g. more KV cache than the whole pool, or stop ids outside the vocabulary
            message = str(e)
            param = param_named_in(message, [f.name for f in dataclasses.fields(params)])
            raise bad_request(message, param=param or ("max_tokens" if "max_tokens" in message else None)) from None
        return params


def _longest_token_chars(tokenizer) -> int | None:
    """The longest vocabulary entry, in characters (None: no tokenizer, or no vocabulary to read).

    A token's text is at most as long as its entry (byte-level BPE spells one byte per character, sentencepiece
    one character per character), so text of n characters takes at least n / longest tokens.
    """
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    except Exception:
        return None
    return longest or None


def _text_length(value: Any) -> int:
    """Characters in all the strings of a message (its content, role and any other fields)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_length(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_length(v) for v in value)
    return 0


def _prompt_logprobs_field(tokenizer, output: RequestOutput) -> dict:
    entries = getattr(output, "prompt_logprobs", None)
    return {} if entries is None else {"prompt_logprobs": prompt_logprobs(tokenizer, entries)}


def _n(params) -> int:
    return int(getattr(params, "n", 1) or 1)


_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
# JSON may carry these raw, but many clients' line readers (httpx's aiter_lines, Python's splitlines) end a
# line at them, cutting an event in two; escaped, every event is one line to any reader.
_UNICODE_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def _encode(value) -> str:
    return _json(value).translate(_UNICODE_LINE_BREAKS)


def _event(payload: dict) -> str:
    return f"data: {_encode(payload)}\n\n"


class _ChunkTemplate:
    """A stream's common chunk (one choice, no logprobs, not its last) as one format string: the envelope is
    fixed per stream, so only the new text is JSON-encoded (several times cheaper than ``_event`` of the whole
    dict; the same JSON, key for key)."""

    def __init__(self, request_id: str, obj: str, created: int, model: str, include_usage: bool,
                 return_token_ids: bool):
        self.head = (f'data: {{"id":{_encode(request_id)},"object":{_encode(obj)},"created":{created},'
                     f'"model":{_encode(model)},"choices":[{{"index":')
        self.tail = '}],"usage":null}\n\n' if include_usage else "}]}\n\n"
        self.ids = return_token_ids

    def _token_ids(self, token_ids: list[int]) -> str:
        return f',"token_ids":[{",".join(map(str, token_ids))}]' if self.ids else ""

    def completion(self, index: int, text: str, token_ids: list[int]) -> str:
        return (f'{self.head}{index},"text":{_encode(text)},"logprobs":null,"finish_reason":null,'
                f'"stop_reason":null{self._token_ids(token_ids)}{self.tail}')

    def chat(self, index: int, delta: dict, token_ids: list[int]) -> str:
        return (f'{self.head}{index},"delta":{_encode(delta)},"logprobs":null,"finish_reason":null,'
                f'"stop_reason":null{self._token_ids(token_ids)}{self.tail}')


class _EventStream(Response):
    """A stream of server-sent events, one body message per event. Unlike Starlette's StreamingResponse it runs
    no task of its own per response to watch for a disconnect: each stream's ``_Job`` already watches, aborts the
    requests and ends the events, and a send to a client that is gone is dropped by the server."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()  # its requests are aborted now if it did not finish (a send failed)


class _Progress:
    """What has been streamed of each choice (its outputs are DELTA: each holds only what is new)."""

    def __init__(self):
        self.tokens: dict[int, int] = {}  # index -> tokens streamed
        self.done: set[int] = set()  # choices whose finish was streamed

    def advance(self, index: int, c) -> tuple[str, list[int], list | None, bool]:
        """(new text, new token ids, their logprobs, whether it just finished) of choice ``index``."""
        if index in self.done:
            return "", [], None, False
        finish = c.finish_reason is not None
        if finish:
            self.done.add(index)
        self.tokens[index] = self.tokens.get(index, 0) + len(c.token_ids)
        return c.text, c.token_ids, c.logprobs, finish

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens.values())


class _Job:
    """The engine requests of one HTTP request: added together, merged, aborted if the client disconnects.

    ``start()`` adds them from the handler, before any response begins: a full queue (429) or a stopped engine
    (503) is answered with its status, never as an error event inside a 200 stream. From then on the client is
    watched, so a client that leaves aborts them even if their response never starts.
    """

    def __init__(self, llm: EngineClient, raw: Request, request_id: str, prompts: list[Any], params: list):
        self.llm = llm
        self.raw = raw
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.request_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.disconnected = False
        self.error: APIError | None = None
        self.prompt_tokens: dict[int, int] = {}
        self.streams: list[RequestStream] = []
        self._watcher: asyncio.Future | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens.values())

    def start(self) -> _Job:
        """Add the requests and watch the client; EngineDeadError or QueueFullError aborts those already added."""
        try:
            for prompt, params, request_id in zip(self.prompts, self.params, self.request_ids, strict=True):
                self.streams.append(self.llm.add_request(prompt, params, request_id))
        except BaseException:
            self.close()
            raise
        self._watcher = asyncio.ensure_future(self._watch_disconnect())
        return self

    def close(self) -> None:
        """Stop watching the client, and abort whatever has not finished (idempotent)."""
        if self._watcher is not None:
            self._watcher.cancel()
        for stream in self.streams:
            stream.close()

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.raw.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                for request_id in self.request_ids:
                    self.llm.abort(request_id)
                return

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, until every request has finished or was aborted.

        Stops early on an error, with ``self.error`` set; yields nothing more once the client is gone.
        """
        try:
            async for i, output in _merge(self.streams):
                self.prompt_tokens[i] = len(output.prompt_token_ids)
                if not self.disconnected:
                    yield i, output
        except EngineDeadError as e:
            self.error = APIError(503, str(e), type="service_unavailable")
        except RequestFailedError as e:  # a fault in this request's processing; the engine serves on
            self.error = APIError(500, str(e), code="request_failed")
        except ValueError as e:  # the engine's own checks of a request
            self.error = bad_request(str(e))
        finally:
            self.close()

    async def finals(self) -> list[RequestOutput] | None:
        """The finished output of each prompt; None if the client disconnected first."""
        finals: list[RequestOutput | None] = [None] * len(self.prompts)
        async for i, output in self.outputs():
            finals[i] = output
        if self.error is not None:
            raise self.error
        if self.disconnected:
            return None
        return finals


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave request streams as their outputs come, as (index, output); the caller closes the streams."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, stream: RequestStream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        finally:
            queue.put_nowait((i, done, None))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
