"""The engine core in a process of its own: it admits, schedules, steps and samples, and after each step sends
one message with only what is new (per sample: the new token ids, the finish reason, new logprobs); steps that
queued while the front end was behind go as one message (``merge_steps``), and the step loop never waits for it.

```
  front end (HTTP, tokenizer, detokenizer, stop strings)          engine core process (this module)
  ──────────────────────────────────────────────────────          ─────────────────────────────────
  ("add", id, prompt ids, params)  ─┐                       ┌─▶ engine.add_request (no text: no detokenizer)
  ("abort", [ids])                  ├─ one duplex pipe ─────┤   engine.step() while there is work
  ("stop_sample", id, i, string)    │  (pickled tuples)     │
  ("stop",)                        ─┘                       └── ("step", [SampleDelta...], CoreStats) per step
```

The core never builds text: the front end detokenizes, checks stop strings, and sends ``stop_sample`` when a
sample's text reached one, which frees its blocks before the next step. A request's SamplingParams travel as
they are (plain data, pickled); the core gets a copy without stop strings. A fault of the whole step (the model,
the scheduler) ends the process after a ("dead", why) message; the front end notices the pipe closing in any case.

With ``--api-server-count N`` the core has one such pipe per front end (``EngineCore``'s docstring says how outputs
and stats are shared out); see server/front_ends.py.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import queue
import signal
import threading
from dataclasses import dataclass
from typing import Any

from nanovllm.engine.host_memory import HeapTrimmer
from nanovllm.engine.input_processor import RequestLimits

logger = logging.getLogger(__name__)

# a step that prefilled this many tokens left working memory worth handing back (host_memory.py)
TRIM_AFTER_PREFILL_TOKENS = 512


@dataclass
class CoreInfo:
    """What the front end needs of the engine, sent once the core is ready."""

    model_path: str
    tokenizer: Any  # the engine's own tokenizer (pickled across): the front end tokenizes and detokenizes
    limits: RequestLimits
    max_num_seqs: int
    eos_token_ids: list[int]
    pid: int
    kv_cache: str  # the KV pool's size and token capacity, as engine/summary.py says it at start
    device: str  # where the model runs ("cpu", "cuda", "cuda:1")


# What one step added to one sample of a request, as a plain tuple (unpickling a NamedTuple calls its class per
# row: 4x slower for a step of 256 samples, see docs/architecture.md):
#   (request_id, index (which of the n samples), new token ids, finish_reason ("stop", "length", "error" with
#    stop_reason saying why, "rejected" for an add the engine refused, or None while running), stop_reason,
#    new logprobs (one {token id: Logprob} per new token, or None), cumulative_logprob,
#    first ((num_cached_tokens, prompt_logprobs) with sample 0's first tokens, else None))
SampleDelta = tuple
# The scheduler's state after a step; counters are deltas since the previous message:
#   (num_running, num_waiting, kv_cache_usage, num_preemptions, prefix_cache_queries, prefix_cache_hits)
CoreStats = tuple


class EngineCore:
    """Runs an engine for its front ends until each has said stop: ``conns`` is one multiprocessing Connection, or
    a list of them (``--api-server-count``). A request's outputs go to the front end that added it; every front end
    hears the scheduler's state, and its counters go to the first front end still connected, which hears of every
    step (so the front ends' metrics add up across processes)."""

    def __init__(self, engine, conns):
        self.engine = engine
        self.conns = list(conns) if isinstance(conns, (list, tuple)) else [conns]
        self.live = list(range(len(self.conns)))  # front ends that have neither stopped nor gone
        self.num_sent: dict[str, list[int]] = {}  # request id -> tokens sent of each sample
        self.owner: dict[str, int] = {}  # request id -> the front end that added it
        self.rejected: list[list[SampleDelta]] = [[] for _ in self.conns]  # refused adds, sent with the next message
        self.counters = self._read_counters()
        self.heap = HeapTrimmer()
        self.outboxes: list[_Outbox] = []

    def run(self) -> None:
        engine = self.engine
        self.outboxes = [_Outbox(conn) for conn in self.conns]
        self.heap.trim(busy=False)  # what loading the model freed
        try:
            while True:
                changed = self._handle_commands(block=not engine.has_unfinished_requests())
                if changed is None:
                    break
                stepped = engine.has_unfinished_requests()
                self._send_step(self._step() if stepped else {}, changed, stepped)
                if stepped:
                    self._release_freed_memory()
        finally:
            for outbox in self.outboxes:
                outbox.close()

    def _send_step(self, deltas: dict[int, list[SampleDelta]], changed: set[int], stepped: bool) -> None:
        """Each front end's message of a step: its requests' deltas and the scheduler's state."""
        first = self.live[0] if self.live else None
        several = len(self.conns) > 1
        for index in self.live:
            mine = deltas.get(index)
            if mine or index in changed or self.rejected[index] or (several and stepped and index == first):
                if self.rejected[index]:
                    mine, self.rejected[index] = self.rejected[index] + (mine or []), []
                self.outboxes[index].put(("step", mine or [], self._stats(counters=index == first)))

    def _release_freed_memory(self) -> None:
        """After a prefill (whose working memory glibc would keep) or once idle, hand the heap's free pages back."""
        idle = not self.engine.has_unfinished_requests()
        if idle or self.engine.last_step.prefill_tokens >= TRIM_AFTER_PREFILL_TOKENS:
            self.heap.trim(busy=not idle)

    def _handle_commands(self, block: bool) -> set[int] | None:
        """Apply the commands that came (waiting for one if ``block``); the front ends that sent any; None once
        every front end has said stop. EOFError once the last front end went away without saying it."""
        changed: set[int] = set()
        if len(self.conns) == 1:  # the common case: no select call per step
            conn = self.conns[0]
            while block or conn.poll():
                block = False
                changed.add(0)
                if not self._apply(0, conn.recv()):
                    return None
            return changed
        from multiprocessing.connection import wait
        while self.live:
            ready = wait([self.conns[i] for i in self.live], timeout=None if block else 0)
            if not ready:
                return changed
            block = False
            for conn in ready:
                index = self.conns.index(conn)
                changed.add(index)
                try:
                    while index in self.live and conn.poll():
                        self._apply(index, conn.recv())
                except (EOFError, OSError):  # that front end is gone: nobody reads its requests' outputs
                    self._drop(index)
                    if not self.live:
                        raise EOFError("every front end is gone") from None
        return None

    def _apply(self, front_end: int, command: tuple) -> bool:
        """One command of a front end; False if it said stop (it then has its last message)."""
        kind = command[0]
        if kind == "add":
            self._add(*command[1:], front_end=front_end)
        elif kind == "abort":
            for request_id in command[1]:
                if self.num_sent.pop(request_id, None) is not None:
                    del self.owner[request_id]
                    self.engine.abort_request(request_id)
        elif kind == "stop_sample":
            _, request_id, index, stop = command
            if request_id in self.num_sent:
                self.engine.stop_sample(request_id, index, stop)
                self._forget_if_finished(request_id)
        elif kind == "stop":
            self._drop(front_end)
            self.outboxes[front_end].put(("stopped", self._stats(counters=not self.live)))
            return False
        else:
            raise ValueError(f"unknown command {kind!r}")
        return True

    def _drop(self, front_end: int) -> None:
        """A front end that stopped or went away: its requests are aborted."""
        if front_end in self.live:
            self.live.remove(front_end)
        for request_id in [r for r, owner in self.owner.items() if owner == front_end]:
            del self.owner[request_id]
            del self.num_sent[request_id]
            self.engine.abort_request(request_id)

    def _add(self, request_id: str, token_ids: list[int], params, front_end: int = 0) -> None:
        try:
            self.engine.add_request({"prompt_token_ids": token_ids}, params, request_id)
        except ValueError as e:  # the request's own fault: only it is refused
            self.rejected[front_end].append((request_id, -1, [], "rejected", str(e), None, None, None))
            return
        self.num_sent[request_id] = [0] * params.n
        self.owner[request_id] = front_end

    def _step(self) -> dict[int, list[SampleDelta]]:
        """One engine step: the new tokens of each sample it advanced, by the front end that owns the request."""
        engine = self.engine
        requests, num_sent_of, owner = engine.requests, self.num_sent, self.owner
        deltas: dict[int, list[SampleDelta]] = {}
        ended = []
        for seq in engine.step():
            extras = seq.extras
            request_id = extras.request_id
            num_sent = num_sent_of.get(request_id)
            if num_sent is None:
                continue
            state = requests[request_id]
            index = extras.index
            sample = state.samples[index]
            before = num_sent[index]
            new = seq.token_ids[seq.num_prompt_tokens + before:]
            num_sent[index] = before + len(new)
            logprobs = sample.logprobs[before:] if sample.logprobs is not None else None
            first = (state.num_cached_tokens or 0, state.prompt_logprobs) if index == 0 and before == 0 else None
            finish, stop_reason = extras.finish_reason, extras.stop_reason
            if state.error is not None:
                finish, stop_reason = "error", state.error
            if finish is not None:
                ended.append(request_id)
            deltas.setdefault(owner[request_id], []).append(
                (request_id, index, new, finish, stop_reason, logprobs, sample.cumulative_logprob, first))
        for request_id in dict.fromkeys(ended):  # only a sample that ended can end its request
            self._forget_if_finished(request_id)
        return deltas

    def _forget_if_finished(self, request_id: str) -> None:
        if self.engine.is_request_finished(request_id):
            self.engine.forget_request(request_id)
            del self.num_sent[request_id]
            del self.owner[request_id]

    def _read_counters(self) -> tuple[int, int, int]:
        scheduler = self.engine.scheduler
        bm = scheduler.block_manager
        return scheduler.stats.num_preemptions, bm.num_queried_tokens, bm.num_hit_tokens

    def _stats(self, counters: bool = True) -> CoreStats:
        """The scheduler's state, and its counters since they were last sent (zeros if not ``counters``)."""
        scheduler = self.engine.scheduler
        state = (len(scheduler.running), len(scheduler.waiting), scheduler.block_manager.usage)
        if not counters:
            return (*state, 0, 0, 0)
        now = self._read_counters()
        before, self.counters = self.counters, now
        return (*state, now[0] - before[0], now[1] - before[1], now[2] - before[2])


class _Outbox:
    """Messages to the front end, sent by a thread of their own: the step loop never waits for a front end that
    is behind (a full pipe), and the steps that queued meanwhile go as one message (their deltas in order, the
    newest scheduler state, the counters summed), so a busy front end gets fewer, larger hand-overs."""

    def __init__(self, conn):
        self.conn = conn
        self.queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="nanovllm-core-outbox", daemon=True)
        self.thread.start()

    def put(self, message: tuple) -> None:
        self.queue.put(message)

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            try:
                for message in merge_steps(batch):
                    if message is None:
                        return
                    self.conn.send(message)
            except (OSError, ValueError):  # the front end is gone: the step loop notices on its next read
                return


def merge_steps(batch: list[tuple | None]) -> list[tuple | None]:
    """Consecutive ("step", deltas, stats) messages as one; others (and their order) kept. The first step's list of
    deltas takes the later ones' (the messages are the caller's own)."""
    merged: list[tuple | None] = []
    for message in batch:
        last = merged[-1] if merged else None
        if message is not None and message[0] == "step" and last is not None and last[0] == "step":
            _, deltas, stats = last
            deltas.extend(message[1])
            new_stats = message[2]
            merged[-1] = ("step", deltas, new_stats[:3] + tuple(
                a + b for a, b in zip(stats[3:], new_stats[3:], strict=True)))
        else:
            merged.append(message)
    return merged


def core_params(params):
    """The params the core runs a request with: the front end handles text, so no stop strings and no text."""
    return dataclasses.replace(params, stop=[], detokenize=False)


def run_engine_core(conns, engine_args: dict) -> None:
    """Process target: say ("loading", what it loads), build the engine, say ("ready", CoreInfo) or ("failed",
    why), then serve ``conns`` (one Connection, or one per front end: each hears all of this). The front end never
    imports torch: the engine's arguments are checked here."""
    import os
    import sys
    import warnings

    # Ctrl-C (or a SIGTERM sent to the whole process group) reaches the core too: the front ends drain and then
    # stop it, not the signal (a front end that is gone closes its pipe, which ends the core as well)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = None
    every = list(conns) if isinstance(conns, (list, tuple)) else [conns]

    def tell(message: tuple) -> None:
        for conn in every:
            try:
                conn.send(message)
            except OSError:  # that front end is gone
                pass

    try:
        _bind_device(engine_args.get("device"))
        from nanovllm.config import EngineConfig
        from nanovllm.engine.summary import kv_cache_line, loading_line
        with warnings.catch_warnings():  # the engine checks the same arguments again, and warns then
            warnings.simplefilter("ignore")
            known = {k: v for k, v in engine_args.items() if k in EngineConfig.field_names()}  # LLMEngine names
            tell(("loading", loading_line(EngineConfig(**known))))  # the others, below
        from nanovllm.engine.llm_engine import LLMEngine
        engine = LLMEngine(**engine_args)
        if engine.config.device == "cpu" and engine.config.tensor_parallel_size == 1:
            _leave_a_core_to_the_front_end()
        info = CoreInfo(engine.model_path, engine.tokenizer, engine.request_limits, engine.config.max_num_seqs,
                        sorted(engine.eos_token_ids), os.getpid(), kv_cache_line(engine), str(engine.config.device))
    except BaseException as e:
        try:  # the exception itself, so the front end can raise a user's error (a bad path, a bad flag) as such
            pickle.dumps(e)
        except Exception:
            e = RuntimeError(f"{type(e).__name__}: {e}")
        tell(("failed", e))
        if engine is not None:
            engine.close()
        sys.exit(1)
    tell(("ready", info))
    status = 0
    try:
        EngineCore(engine, every).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        status = 1  # the front end is gone: nobody to serve
    except BaseException as e:
        logger.exception("the engine core failed")
        tell(("dead", f"{type(e).__name__}: {e}"))
        status = 1
    finally:
        engine.close()
    sys.exit(status)


def _leave_a_core_to_the_front_end() -> None:
    """On the CPU the front end is a busy process of its own: a step's OpenMP team as wide as the machine then
    waits at every barrier for a thread the front end displaced (measured: 2 threads of 2 cores 10-15x slower
    per step than 1 when the cores are shared), so the core takes one core less."""
    import torch
    torch.set_num_threads(max(1, torch.get_num_threads() - 1))


def _bind_device(device) -> None:
    if device is not None and str(device).startswith("cuda"):
        import torch
        index = torch.device(device).index
        if index is not None:
            torch.cuda.set_device(index)
