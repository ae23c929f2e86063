"""AsyncEngineClient: the server's front end to an engine core running in its own process (``core.py``).

```
  event loop (HTTP handlers)            output thread (this process)               engine core process
  ──────────────────────────            ────────────────────────────               ───────────────────
  add_request() ── tokenized, checked ──────────────── ("add", ...) ─────────────▶ admits, steps, samples
  RequestStream ◀─ one hand-over per   ◀── detokenize, stop strings, ◀── ("step", new tokens) ──┘
                   step and event loop      stats; ("stop_sample") ──────────────▶ frees its blocks
  abort()  ──────────────────────────────────────────── ("abort", [id]) ──────────▶
```

The engine's step loop runs beside this interpreter, not inside it: HTTP, JSON and text never take the GIL from
the step loop. Per step the core sends only what is new, and the output thread turns it into each request's
outputs in one pass (DELTA outputs cost what is new, never what came before).

The core's death (the pipe closes, or it reports a fault of the whole step) ends every open request with
EngineDeadError, refuses new ones, and calls ``on_dead`` (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nanovllm.engine.async_engine import (
    EngineClient,
    EngineDeadError,
    FinishedRequestStats,
    IterationStats,
    RequestFailedError,
    RequestStream,
    StatsListener,
    _Deliveries,
    _RequestState,
)
from nanovllm.engine.core import CoreStats, SampleDelta, core_params, merge_steps, run_engine_core
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.input_processor import InputProcessor
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams
from nanovllm.structured_outputs import GrammarBackend

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # loading a large model (and compiling its kernels) may take minutes
STOP_TIMEOUT_S = 30.0


# (this front end's Connection, the core's CoreInfo): a core that start_engine_core started for several
AttachedCore = tuple


def join_engine_core(proc, timeout: float) -> None:
    """Wait for a core process told to stop (or left without front ends); kill it if it is still there after
    ``timeout`` seconds."""
    proc.join(timeout)
    if proc.is_alive():
        logger.warning("the engine core did not stop within %s s: killing it", timeout)
        proc.kill()
        proc.join()


def start_engine_core(engine_args: dict, num_front_ends: int, timeout: float = STARTUP_TIMEOUT_S):
    """Start an engine core process with a pipe per front end and wait until it is ready: (the process, the front
    ends' Connections, CoreInfo). The user's own error (a bad model path or flag) is raised as the engine raised
    it; others as RuntimeError."""
    from multiprocessing.connection import wait
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked; nor can torch's threads
    pipes = [context.Pipe(duplex=True) for _ in range(num_front_ends)]
    ends = [child for _, child in pipes]
    # not a daemon: the core may start tensor-parallel workers of its own; it exits when the pipes close
    proc = context.Process(target=run_engine_core, args=(ends[0] if num_front_ends == 1 else ends, engine_args),
                           name="nanovllm-core")
    proc.start()
    for child in ends:
        child.close()
    conns = [conn for conn, _ in pipes]
    deadline = time.monotonic() + timeout
    info = None
    for index, conn in enumerate(conns):  # each pipe hears the same; the first one's "loading" is logged
        while True:
            ready = wait([conn, proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            if conn in ready:
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    kind, payload = "failed", None
                if kind == "loading":  # what the core loads, before the weights are read
                    if index == 0:
                        logger.info("%s", payload)
                    continue
                if kind == "ready":
                    info = payload
                    break
                proc.join(5)
                if isinstance(payload, (FileNotFoundError, ValueError, TypeError)):
                    raise payload  # the user's own error (a bad model path or flag), as the engine raised it
                why = f"{type(payload).__name__}: {payload}" if payload else f"exit code {proc.exitcode}"
                raise RuntimeError(f"the engine core failed to start: {why}")
            if proc.sentinel in ready:
                proc.join()
                raise RuntimeError(f"the engine core exited with code {proc.exitcode} while starting")
            if not ready:
                proc.kill()
                raise RuntimeError(f"the engine core did not start within {timeout:.0f} s")
    return proc, conns, info  # (CoreInfo)


@dataclass
class _Sample:
    """One of a request's n samples as the front end builds it: its text, and what it has handed out."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)  # all of them (CUMULATIVE / FINAL_ONLY only)
    logprobs: list | None = None
    num_tokens: int = 0
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_chars: int = 0
    pending_ids: list[int] = field(default_factory=list)  # DELTA: not yet handed out
    pending_logprobs: list | None = None


@dataclass
class _Request:
    state: _RequestState
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class AsyncEngineClient(EngineClient):
    """Starts an engine core process for ``engine_args`` and serves its requests to asyncio callers.

    The same interface as ``AsyncLLM`` (add_request, generate, abort, check_admission, stop_admissions,
    shutdown, stats_listeners, the engine's fixed attributes).
    """

    def __init__(self, engine_args: dict | None, *, max_queued_requests: int | None = None,
                 stats_listeners: list[StatsListener] | None = None, startup_timeout: float = STARTUP_TIMEOUT_S,
                 core: AttachedCore | None = None):
        """Start a core for ``engine_args``, or (``core``) serve through a core that another process started for
        several front ends (``start_engine_core``): that process owns it, and stops it."""
        self.max_queued_requests = max_queued_requests
        self.stats_listeners: list[StatsListener] = list(stats_listeners or [])
        self.on_dead: list[Callable[[], None]] = []  # called (from the output thread) if the core dies
        self.error: BaseException | None = None
        self.draining = False
        self._closed = False
        self._stopping = False
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()  # the request table: the event loop adds and aborts, the output thread steps
        # Messages to the core go through a thread of their own: no sender ever blocks on a full pipe (the core
        # may itself be blocked sending a step to the output thread, which must keep reading).
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._finished_stats: list[FinishedRequestStats] = []  # aborts since the last message
        if core is None:
            self._proc, (self._conn,), info = start_engine_core(engine_args, 1, startup_timeout)
        else:
            self._proc = None
            self._conn, info = core
        self.core_pid = info.pid
        self.model_path = info.model_path
        self.tokenizer = info.tokenizer
        self.max_model_len = info.limits.max_model_len
        self.vocab_size = info.limits.vocab_size
        self.max_num_seqs = info.max_num_seqs
        self.kv_cache_summary = info.kv_cache
        self.device = info.device
        self.inputs = InputProcessor(self.tokenizer, info.limits)
        # the front end's own compiler, only to refuse a constraint before a response starts (the core compiles
        # the request's grammar again, in its own cache)
        self._grammars = GrammarBackend(self.tokenizer, self.vocab_size, info.eos_token_ids)
        self._thread = threading.Thread(target=self._read_loop, name="nanovllm-outputs", daemon=True)
        self._thread.start()
        self._sender = threading.Thread(target=self._send_loop, name="nanovllm-to-core", daemon=True)
        self._sender.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, max_queued_requests: int | None = None,
                         **engine_args) -> AsyncEngineClient:
        return cls(dict(engine_args, model=model), max_queued_requests=max_queued_requests)

    def check_structured_outputs(self, constraint) -> None:
        self._grammars.compile(constraint)  # a model without tokenizer is refused there, by name

    # -- caller side (event loop) ---------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def add_request(self, prompt, sampling_params: SamplingParams, request_id: str) -> RequestStream:
        """Send a request to the core; iterate the returned stream for its outputs.

        Raises EngineDeadError or QueueFullError at once; a ValueError of the request's checks is raised by the
        stream's first iteration (as AsyncLLM does).
        """
        state = _RequestState(asyncio.Queue(), asyncio.get_running_loop(), time.monotonic())
        state.output_kind = getattr(sampling_params, "output_kind", RequestOutputKind.CUMULATIVE)
        stream = RequestStream(self, request_id, state, state.output_kind == RequestOutputKind.DELTA)
        with self._lock:
            self.check_admission()
            try:
                request = self._new_request(prompt, sampling_params, request_id, state)
            except ValueError as e:
                state.outputs.put_nowait(e)
                return stream
            self._requests[request_id] = request
        self._send(("add", request_id, request.prompt_token_ids, core_params(sampling_params)))
        return stream

    def _new_request(self, prompt, params: SamplingParams, request_id: str, state: _RequestState) -> _Request:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        text, token_ids = self.inputs.tokenize_prompt(prompt)
        self.inputs.validate_request(token_ids, params)
        samples = []
        for index in range(params.n):
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
            sample = _Sample(index, detokenizer)
            if params.logprobs is not None:
                sample.logprobs, sample.pending_logprobs = [], []
            samples.append(sample)
        return _Request(state, text, token_ids, params, samples)

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread): its stream ends with finish_reason "abort", and the core frees its
        blocks before its next step."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is None:
                return
            for sample in request.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "abort"
            self._finished_stats.append(self._finished(request, "abort", time.monotonic()))
            request.state.deliver(self._output(request_id, request))
        self._send(("abort", [request_id]))

    def shutdown(self, timeout: float | None = STOP_TIMEOUT_S) -> None:
        """Abort what is left, stop the core process and wait for it."""
        self._stopping = True
        self._send(("stop",))
        self._outbox.put(None)
        self._thread.join(timeout)
        if self._proc is not None:  # (an attached core belongs to the process that started it)
            join_engine_core(self._proc, timeout)
        self._conn.close()

    def _send(self, message: tuple) -> None:
        self._outbox.put(message)

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the core is gone: the output thread tells everyone
                return

    # -- output thread --------------------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        error: BaseException | None = None
        try:
            done = False
            while not done:
                batch = [self._conn.recv()]
                while self._conn.poll():  # behind the core: what has come is taken in one pass
                    try:
                        batch.append(self._conn.recv())
                    except EOFError:  # the core is gone: take in what it said first
                        break
                for message in merge_steps(batch):
                    if message[0] == "step":
                        self._process(message[1], message[2])
                    elif message[0] == "stopped":
                        self._publish(IterationStats(0, 0, 0.0), message[1])
                        done = True
                        break
                    elif message[0] == "dead":
                        error = EngineDeadError(f"the engine failed: {message[1]}")
                        done = True
                        break
        except (EOFError, OSError):
            if self._proc is not None:
                self._proc.join(2)
                how = f"exit code {self._proc.exitcode}"
            else:
                how = f"pid {self.core_pid}"
            error = EngineDeadError(f"the engine core process died ({how}).")
        except BaseException as e:  # a bug of this thread: nothing could reach the callers any more
            logger.exception("the output thread failed")
            error = EngineDeadError(f"the server's output thread failed: {e!r}")
        if error is not None and not self._stopping:
            logger.error("%s The server takes no more requests.", error)
            self.error = error
        self._fail_all(error or EngineDeadError("the server is shutting down."), abort=error is None)
        if error is not None and not self._stopping:
            for callback in self.on_dead:
                try:
                    callback()
                except Exception:
                    logger.exception("an on_dead callback failed")

    def _process(self, deltas: list[SampleDelta], core_stats: CoreStats) -> None:
        """One core step: every touched request's output built in one pass and handed over once per loop."""
        now = time.monotonic()
        stats = IterationStats(0, 0, 0.0)
        deliveries = _Deliveries()
        stops = []
        with self._lock:
            touched: dict[str, _Request] = {}
            for delta in deltas:
                request_id = delta[0]
                request = self._requests.get(request_id)
                if request is None:  # aborted, or stopped here while the core ran on
                    continue
                if delta[3] == "rejected":
                    del self._requests[request_id]
                    request.state.deliver(ValueError(delta[4]))
                    continue
                touched[request_id] = request
                stop = self._take(request, *delta[1:], stats, now)
                if stop is not None:
                    stops.append(("stop_sample", request_id, delta[1], stop))
            for request_id, request in touched.items():
                failed = next((s.stop_reason for s in request.samples if s.finish_reason == "error"), None)
                finished = failed is not None or request.finished
                if finished:
                    del self._requests[request_id]
                    reason = "error" if failed is not None else next(
                        (s.finish_reason for s in request.samples if s.finish_reason), "stop")
                    stats.finished.append(self._finished(request, reason, now))
                if failed is not None:
                    deliveries.add(request.state, RequestFailedError(f"the request failed: {failed}"))
                elif finished or request.state.output_kind != RequestOutputKind.FINAL_ONLY:
                    deliveries.add(request.state, self._output(request_id, request))
            stats.finished[:0], self._finished_stats = self._finished_stats, []
        deliveries.send()
        for stop in stops:  # the core frees the sample's blocks before its next step
            self._send(stop)
        self._publish(stats, core_stats)

    def _take(self, request: _Request, index: int, token_ids: list[int], finish: str | None, stop_reason,
              logprobs: list | None, cumulative_logprob: float | None, first, stats: IterationStats,
              now: float) -> str | None:
        """Take in a sample's new tokens (one SampleDelta); the stop string its text reached while the core runs
        it, if any."""
        state = request.state
        sample = request.samples[index]
        if first is not None:
            request.num_cached_tokens, request.prompt_logprobs = first
        if sample.finish_reason is not None or not token_ids and finish is None:
            return None
        if token_ids:
            if state.first_token_time is None:
                state.first_token_time = now
                state.num_prompt_tokens = len(request.prompt_token_ids)
                stats.time_to_first_token.append(now - state.arrival_time)
                stats.num_prompt_tokens += state.num_prompt_tokens
            elif state.last_token_time != now:
                stats.inter_token_latency.append(now - state.last_token_time)
            stats.num_generation_tokens += len(token_ids)
            state.num_generation_tokens += len(token_ids)
            state.last_token_time = now
        sample.num_tokens += len(token_ids)
        delta_mode = state.output_kind == RequestOutputKind.DELTA
        (sample.pending_ids if delta_mode else sample.token_ids).extend(token_ids)
        if sample.logprobs is not None and logprobs is not None:
            (sample.pending_logprobs if delta_mode else sample.logprobs).extend(logprobs)
        sample.cumulative_logprob = cumulative_logprob
        found = self._update_text(request, sample, token_ids, finish, stop_reason)
        if found is not None:
            sample.finish_reason, sample.stop_reason = "stop", found
            return found if finish is None else None
        sample.finish_reason, sample.stop_reason = finish, stop_reason
        return None

    @staticmethod
    def _update_text(request: _Request, sample: _Sample, token_ids: list[int], finish: str | None,
                     stop_reason) -> str | None:
        """Feed the detokenizer (as LLMEngine does in-process); the stop string the text reached, if any."""
        detokenizer = sample.detokenizer
        if detokenizer is None or finish == "error":
            return None
        params = request.params
        if finish == "stop" and not isinstance(stop_reason, str) and not params.include_stop_str_in_output:
            token_ids = token_ids[:-1]  # the EOS / stop token's text is left out, as vLLM does
        stop = detokenizer.update(token_ids) if token_ids else None
        if finish is not None and stop is None:
            stop = detokenizer.finish()
        if stop is not None:
            detokenizer.finish()
        return stop

    def _output(self, request_id: str, request: _Request) -> RequestOutput:
        delta_mode = request.state.output_kind == RequestOutputKind.DELTA
        outputs = []
        for sample in request.samples:
            detokenizer = sample.detokenizer
            finished = sample.finish_reason is not None
            text = detokenizer.output_text(finished) if detokenizer is not None else ""
            if delta_mode:
                text, sample.num_sent_chars = text[sample.num_sent_chars:], len(text)
                token_ids, sample.pending_ids = sample.pending_ids, []
                logprobs = sample.pending_logprobs
                if logprobs is not None:
                    sample.pending_logprobs = []
            else:
                token_ids = list(sample.token_ids)
                logprobs = list(sample.logprobs) if sample.logprobs is not None else None
            outputs.append(CompletionOutput(sample.index, text, token_ids, sample.finish_reason, sample.stop_reason,
                                            sample.cumulative_logprob, logprobs))
        return RequestOutput(request_id, request.prompt, request.prompt_token_ids, outputs, request.finished,
                             request.num_cached_tokens, request.prompt_logprobs)

    @staticmethod
    def _finished(request: _Request, reason: str, now: float) -> FinishedRequestStats:
        state = request.state
        tpot = None
        if state.num_generation_tokens > 1 and state.first_token_time is not None:
            tpot = (state.last_token_time - state.first_token_time) / (state.num_generation_tokens - 1)
        return FinishedRequestStats(reason, now - state.arrival_time, len(request.prompt_token_ids),
                                    state.num_generation_tokens, tpot)

    def _publish(self, stats: IterationStats, core: CoreStats) -> None:
        (stats.num_running, stats.num_waiting, stats.kv_cache_usage, stats.num_preemptions,
         stats.prefix_cache_queries, stats.prefix_cache_hits) = core
        for listener in self.stats_listeners:
            try:
                listener(stats)
            except Exception:  # metrics must never take the server down
                logger.exception("a stats listener failed")

    def _fail_all(self, error: BaseException, abort: bool = False) -> None:
        """Close for good and end every request: as aborted outputs (a shutdown) or with ``error``."""
        with self._lock:
            self._closed = True
            requests, self._requests = self._requests, {}
            now = time.monotonic()
            stats = IterationStats(0, 0, 0.0)
            for request_id, request in requests.items():
                if abort:
                    for sample in request.samples:
                        if sample.finish_reason is None:
                            sample.finish_reason = "abort"
                    stats.finished.append(self._finished(request, "abort", now))
                    request.state.deliver(self._output(request_id, request))
                else:
                    stats.finished.append(self._finished(request, "error", now))
                    request.state.deliver(error)
            stats.finished[:0], self._finished_stats = self._finished_stats, []
        self._publish(stats, (0, 0, 0.0, 0, 0, 0))
