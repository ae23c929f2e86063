"""AsyncLLM: one background thread owns the engine and steps it; asyncio callers stream their requests' outputs.

```
  event loop (HTTP handlers)                          engine thread
  ──────────────────────────                          ─────────────
  add_request() ──("add", id, prompt, params)──▶  commands ──▶ engine.add_request()
  RequestStream ◀── RequestOutput (cumulative) ─┐              engine.step() while there is work
  abort()       ──("abort", id)─────────────▶   └─ per-request asyncio.Queue, fed with
                                                   loop.call_soon_threadsafe after every step
```

Only the engine thread touches the engine's mutable state (queues, blocks, sequences): callers talk to it
through a thread-safe command queue, so requests join the running batch between two steps (continuous batching
across callers) and an abort frees the request's KV blocks before the next step. Each output is cumulative (the
text and tokens so far), so a slow consumer may skip to the newest one without losing anything.

A fault while processing one request (its detokenizer, its stop strings, building its output) fails that request
alone: its stream raises RequestFailedError, its blocks are freed, and the loop goes on. A fault of the whole step
(the model, the scheduler) stops the loop: every request then fails with EngineDeadError.

Callers may read the engine's fixed attributes (tokenizer, max_model_len, ``validate_request``,
``tokenize_prompt``, ``apply_chat_template``) from their own threads; nothing else.

This is the in-process form (a thread beside the caller's event loop), for tests and embedding; ``nanovllm serve``
runs the engine in a process of its own behind ``nanovllm.engine.core_client.AsyncEngineClient``, which has the
same interface.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from nanovllm.engine.input_processor import InputProcessor
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an internal error or shutdown): no request can be served any more."""


class QueueFullError(RuntimeError):
    """Too many requests are in flight; the caller should retry later."""


class RequestFailedError(RuntimeError):
    """Processing this one request failed inside the engine (e.g. its detokenization); the engine goes on."""


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # seconds from arrival to the last output
    num_prompt_tokens: int
    num_generation_tokens: int
    time_per_output_token: float | None  # mean seconds between output tokens after the first; None if < 2 tokens


@dataclass
class IterationStats:
    """What one turn of the engine loop did, for metrics; counters are deltas since the previous turn."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    num_prompt_tokens: int = 0  # prompt lengths of requests that got their first token
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    # speculative decoding (engine/spec_decode/metrics.py): verify steps, draft tokens, accepted ones (by position)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


StatsListener = Callable[[IterationStats], None]


@dataclass
class _RequestState:
    """A request as the engine thread tracks it; ``outputs`` belongs to the caller's event loop."""

    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival_time: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def deliver(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


class _Deliveries:
    """One step's outputs, handed to each caller's event loop in one call: a wake-up of the loop per step, not
    per request (each ``call_soon_threadsafe`` writes to the loop's wake-up pipe and takes the GIL)."""

    def __init__(self) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}

    def add(self, state: _RequestState, item: RequestOutput | BaseException) -> None:
        self.by_loop.setdefault(state.loop, []).append((state.outputs, item))

    def send(self) -> None:
        for loop, items in self.by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


class RequestStream:
    """The outputs of one request, as an async iterator; ``close()`` aborts the request if it is unfinished.

    When several outputs are ready they come as one: the newest (CUMULATIVE), or all of them folded together
    (DELTA). A cancelled iteration aborts the request too: a caller that is gone frees its KV blocks at once.
    ``llm`` is whatever serves the request: anything with ``abort(request_id)``.
    """

    def __init__(self, llm, request_id: str, state: _RequestState, delta: bool = False):
        self.llm = llm
        self.request_id = request_id
        self._outputs = state.outputs
        self._delta = delta
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._outputs.get()
        except BaseException:  # cancelled: whoever waited for this request is gone
            self.close()
            raise
        while not self._outputs.empty() and not isinstance(item, BaseException):
            later = self._outputs.get_nowait()
            if self._delta and not isinstance(later, BaseException):
                item.add(later)
            else:
                item = later
        if isinstance(item, BaseException):
            self.finished = True  # the engine side has already forgotten the request
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.llm.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


class EngineClient:
    """What the server needs of an engine, whether stepped in process (AsyncLLM) or in a process of its own
    (``core_client.AsyncEngineClient``): admission, request streams, the request checks (``inputs``)."""

    inputs: InputProcessor
    max_num_seqs: int
    max_queued_requests: int | None
    draining: bool  # set by stop_admissions(): in-flight requests finish, new ones are refused
    error: BaseException | None

    num_in_flight: int
    is_running: bool

    def add_request(self, prompt, sampling_params: SamplingParams, request_id: str) -> RequestStream:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        return self.inputs.tokenize_prompt(prompt)

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        self.inputs.validate_request(token_ids, params)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        return self.inputs.apply_chat_template(conversation, add_generation_prompt, chat_template_kwargs)

    def check_structured_outputs(self, constraint) -> None:
        """Compile a StructuredOutputsParams now; ValueError naming the problem if it cannot be used."""
        raise NotImplementedError

    def check_admission(self) -> None:
        """Raise EngineDeadError or QueueFullError if a new request cannot be taken now."""
        if not self.is_running:
            raise EngineDeadError(f"the engine has stopped{f': {self.error!r}' if self.error else ''}.")
        if self.draining:
            raise EngineDeadError("the server is shutting down: it takes no new requests.")
        if self.max_queued_requests is not None:
            limit = self.max_num_seqs + self.max_queued_requests
            if self.num_in_flight >= limit:
                raise QueueFullError(f"the server has {self.num_in_flight} requests in flight, its limit; "
                                     "retry later.")

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a new request (as its output_kind says) until the finished one; leaving early aborts it."""
        stream = self.add_request(prompt, sampling_params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def stop_admissions(self) -> None:
        """Refuse new requests from now on (EngineDeadError), and let those in flight finish: a graceful drain."""
        self.draining = True


class AsyncLLM(EngineClient):
    """Serves an engine (``nanovllm.LLM``) to many asyncio callers at once.

    ``max_queued_requests``: how many requests may wait beyond the engine's ``max_num_seqs`` running ones
    before ``add_request`` raises QueueFullError (None: no limit). ``stats_listeners`` are called from the
    engine thread with each loop turn's IterationStats.
    """

    def __init__(self, engine, *, max_queued_requests: int | None = None,
                 stats_listeners: list[StatsListener] | None = None):
        self.engine = engine
        self.inputs = engine.input_processor
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.max_queued_requests = max_queued_requests
        self.stats_listeners: list[StatsListener] = list(stats_listeners or [])
        # In flight: added and not yet finished in the engine thread. Each counter has one writer thread.
        self._num_added = 0
        self._num_done = 0
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders add_request() against closing
        self._closed = False
        self.draining = False
        self._requests: dict[str, _RequestState] = {}  # engine-thread side only
        self._counters = self._read_counters()
        self._spec_counters: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, max_queued_requests: int | None = None,
                         **engine_args) -> AsyncLLM:
        from nanovllm.llm import LLM
        return cls(LLM(model, **engine_args), max_queued_requests=max_queued_requests)

    # -- what the front end reads (fixed) ------------------------------------------------------------------------
    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.max_num_seqs

    def check_structured_outputs(self, constraint) -> None:
        self.engine.check_structured_outputs(constraint)  # the engine's cache keeps it for the request

    # -- caller side (event loop) -----------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Requests added and not finished yet (queued for the engine, waiting or running)."""
        return self._num_added - self._num_done

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def add_request(self, prompt, sampling_params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request for the engine's next step; iterate the returned stream for its outputs.

        Raises EngineDeadError or QueueFullError at once. The engine's own checks run in its thread: a
        ValueError from them is raised by the stream's first iteration.
        """
        state = _RequestState(asyncio.Queue(), asyncio.get_running_loop(), time.monotonic())
        with self._lock:
            self.check_admission()
            self._num_added += 1
            self._commands.put(("add", request_id, prompt, sampling_params, state))
        delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        return RequestStream(self, request_id, state, delta)

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread): it leaves the batch and frees its KV blocks before the next step."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort what is left, stop the loop and release the engine."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    # -- engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            self._bind_device()
            while True:
                busy = engine.has_unfinished_requests()
                stats = self._new_stats()
                if not self._handle_commands(block=not busy, stats=stats):
                    break
                if engine.has_unfinished_requests():
                    self._step(stats)
                self._publish(stats)
        except BaseException as e:  # an engine bug: fail every request, and refuse new ones
            logger.exception("the engine loop failed; the server can take no more requests")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine failed: {e!r}"))
        else:
            self._fail_all(EngineDeadError("the server is shutting down."), abort=True)
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()

    def _bind_device(self) -> None:
        """Make the engine's GPU current in this thread: kernels launch on the thread's current device."""
        device = str(getattr(self.engine.config, "device", "cpu"))
        if device.startswith("cuda"):
            import torch
            index = torch.device(device).index
            if index is not None:
                torch.cuda.set_device(index)

    def _handle_commands(self, block: bool, stats: IterationStats) -> bool:
        """Apply pending adds and aborts (waiting for one if ``block``); False once told to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, request_id, prompt, params, state = command
                try:
                    self.engine.add_request(prompt, params, request_id)
                except Exception as e:  # the request's own fault (a ValueError): only it fails
                    self._num_done += 1
                    state.deliver(e)
                    continue
                state.output_kind = params.output_kind
                self._requests[request_id] = state
            elif kind == "abort":
                self._abort(command[1], stats)

    def _abort(self, request_id: str, stats: IterationStats) -> None:
        state = self._forget(request_id)
        if state is None:  # finished already, or never added
            return
        output = self.engine.make_output(request_id)
        self.engine.abort_request(request_id)
        for completion in output.outputs:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
        output.finished = True
        stats.finished.append(self._finished_stats(state, output, "abort", time.monotonic()))
        state.deliver(output)

    def _step(self, stats: IterationStats) -> None:
        seqs = self.engine.step()
        now = time.monotonic()
        deliveries = _Deliveries()
        # n > 1 may give a request several sequences: one output per request
        for request_id in dict.fromkeys(seq.extras.request_id for seq in seqs):
            state = self._requests.get(request_id)
            if state is None:
                continue
            try:
                num_generated = self._num_generated(request_id)
                output, error = self._take_output(request_id)
            except Exception as e:  # a per-request fault the engine did not contain: still this request's alone
                self._fail(request_id, state, e, stats, now)
                continue
            if num_generated > state.num_generation_tokens:
                if state.first_token_time is None:
                    state.first_token_time = now
                    state.num_prompt_tokens = len(output.prompt_token_ids)
                    stats.time_to_first_token.append(now - state.arrival_time)
                    stats.num_prompt_tokens += state.num_prompt_tokens
                else:
                    stats.inter_token_latency.append(now - state.last_token_time)
                stats.num_generation_tokens += num_generated - state.num_generation_tokens
                state.num_generation_tokens = num_generated
                state.last_token_time = now
            if output.finished:
                reason = "error" if error is not None else next(
                    (c.finish_reason for c in output.outputs if c.finish_reason), "stop")
                stats.finished.append(self._finished_stats(state, output, reason, now))
            if error is not None:
                deliveries.add(state, RequestFailedError(f"the request failed: {error}"))
            elif output.finished or state.output_kind != RequestOutputKind.FINAL_ONLY:
                deliveries.add(state, output)
        deliveries.send()

    def _num_generated(self, request_id: str) -> int:
        return sum(sample.seq.num_completion_tokens for sample in self.engine.requests[request_id].samples)

    def _take_output(self, request_id: str) -> tuple[RequestOutput, str | None]:
        """The request's output, and why it failed (None if it did not); a finished request is forgotten."""
        output = self.engine.make_output(request_id)
        if not output.finished:
            return output, None
        error = self.engine.request_error(request_id)
        self.engine.forget_request(request_id)
        self._forget(request_id)
        return output, error

    def _fail(self, request_id: str, state: _RequestState, error: Exception, stats: IterationStats,
              now: float) -> None:
        """End one request after an exception in its processing: abort it in the engine (its blocks are freed)."""
        logger.error("request %s failed; the engine goes on", request_id,
                     exc_info=(type(error), error, error.__traceback__))
        self.engine.abort_request(request_id)  # if even this fails, the engine is broken: the loop stops
        if self._forget(request_id) is None:
            return
        stats.finished.append(FinishedRequestStats("error", now - state.arrival_time, state.num_prompt_tokens,
                                                   state.num_generation_tokens, None))
        state.deliver(RequestFailedError(f"the request failed: {type(error).__name__}: {error}"))

    def _forget(self, request_id: str) -> _RequestState | None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._num_done += 1
        return state

    @staticmethod
    def _finished_stats(state: _RequestState, output: RequestOutput, reason: str, now: float) -> FinishedRequestStats:
        tpot = None
        if state.num_generation_tokens > 1 and state.first_token_time is not None:
            tpot = (state.last_token_time - state.first_token_time) / (state.num_generation_tokens - 1)
        return FinishedRequestStats(reason, now - state.arrival_time, len(output.prompt_token_ids),
                                    state.num_generation_tokens, tpot)

    def _fail_all(self, error: BaseException, abort: bool = False) -> None:
        """Close for good, and finish every request: those in the engine and those still in the command queue.

        With ``abort``, requests in the engine end as aborted outputs; otherwise (or if that fails) with ``error``.
        """
        with self._lock:  # after this, add_request() refuses: the drain below sees every add there will be
            self._closed = True
        stats = self._new_stats()
        for request_id, state in list(self._requests.items()):
            if abort:
                try:
                    self._abort(request_id, stats)
                    continue
                except Exception:  # the engine is broken: just tell the caller
                    pass
            self._forget(request_id)
            state.deliver(error)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._num_done += 1
                command[4].deliver(error)
        try:
            self._publish(stats)
        except Exception:
            pass

    # -- statistics -------------------------------------------------------------------------------------------
    def _read_counters(self) -> tuple[int, int, int]:
        scheduler = self.engine.scheduler
        bm = scheduler.block_manager
        return scheduler.stats.num_preemptions, bm.num_queried_tokens, bm.num_hit_tokens

    def _new_stats(self) -> IterationStats:
        return IterationStats(0, 0, 0.0)

    def _publish(self, stats: IterationStats) -> None:
        scheduler = self.engine.scheduler
        preemptions, queries, hits = self._read_counters()
        before = self._counters
        self._counters = (preemptions, queries, hits)
        spec, spec_before = scheduler.spec_stats, self._spec_counters
        per_position = list(spec.accepted_per_position)
        self._spec_counters = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, per_position)
        per_position_before = spec_before[3] + [0] * (len(per_position) - len(spec_before[3]))
        stats = dataclasses.replace(
            stats, num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_cache_usage=scheduler.block_manager.usage, num_preemptions=preemptions - before[0],
            prefix_cache_queries=queries - before[1], prefix_cache_hits=hits - before[2],
            spec_num_drafts=spec.num_drafts - spec_before[0],
            spec_num_draft_tokens=spec.num_draft_tokens - spec_before[1],
            spec_num_accepted_tokens=spec.num_accepted_tokens - spec_before[2],
            spec_accepted_per_position=[a - b for a, b in zip(per_position, per_position_before, strict=True)])
        for listener in self.stats_listeners:
            try:
                listener(stats)
            except Exception:  # metrics must never take the engine down
                logger.exception("a stats listener failed")
