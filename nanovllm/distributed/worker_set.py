"""Rank 0's watch over the worker processes it spawned: start-up, failures named with the worker's own error,
shutdown that leaves no process behind.

Every stage notices a dead worker within seconds instead of waiting for a collective's timeout:
- the rendezvous: each worker checks in on rank 0's store before joining the process group, and rank 0 polls for
  that while watching the processes (a worker that died importing the main script never checks in);
- weight loading, the KV pool agreement and steps: a gloo collective with a dead peer fails at once ("Connection
  closed by peer"); on CUDA a watchdog thread aborts the NCCL group when a worker dies, so that a step blocked on
  the device fails too. Rank 0 then raises ``WorkerFailure`` with what the worker wrote to the store before it
  exited (its traceback), or how it died.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

logger = logging.getLogger(__name__)

STEP_TIMEOUT = datetime.timedelta(minutes=30)
_POLL_SECONDS = 0.05
_DEATH_GRACE_SECONDS = 5.0  # after a failed collective: how long a worker may take to exit (or report) before
# the failure is taken to be rank 0's own

MAIN_GUARD_ADVICE = (
    'Tensor-parallel workers are started with "spawn": each one imports the main module (your script) again. '
    "A script that creates the LLM at its top level creates it again in every worker; put that code under "
    '`if __name__ == "__main__":` (e.g. in a main() function called from there).')


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or raised; the engine cannot go on (close it and make a new one)."""


def ready_key(rank: int) -> str:
    return f"nanovllm/ready/{rank}"


def error_key(rank: int) -> str:
    return f"nanovllm/error/{rank}"


def report_error(store: dist.Store, rank: int) -> None:
    """In a worker, inside ``except``: leave the traceback for rank 0, which names it in its error."""
    try:
        store.set(error_key(rank), traceback.format_exc())
    except Exception:  # the store went with rank 0: nobody is left to tell
        pass


class WorkerSet:
    """The spawned workers (ranks 1..N-1) and the store they meet on; rank 0's side."""

    def __init__(self, processes: list, store: dist.Store | None, abort_on_death: bool):
        self.processes = processes
        self.store = store
        self.broken = False  # a stage failed: the ranks are out of step, only killing the workers is safe
        self._failure: str | None = None  # the first failure found (later ones may be workers rank 0 killed)
        self._stage = "starting"  # what rank 0 does now, for the watchdog's message
        self._closing = False
        self._watchdog = None
        if abort_on_death and processes:
            # NCCL does not notice a dead peer: a step would wait on the device until the group's timeout
            self._watchdog = threading.Thread(target=self._watch, name="nanovllm-worker-watchdog", daemon=True)
            self._watchdog.start()

    # -- failures -------------------------------------------------------------------------------------------------
    def dead(self) -> list[tuple[int, object]]:
        return [(rank, p) for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]

    def _reported(self, rank: int) -> str | None:
        if self.store is None:
            return None
        try:
            return self.store.get(error_key(rank)).decode() if self.store.check([error_key(rank)]) else None
        except Exception:
            return None

    def failure(self, stage: str) -> WorkerFailure | None:
        """The error naming the first worker that died or reported an error, or None if all are well."""
        for rank, process in enumerate(self.processes, start=1):
            reported = self._reported(rank)
            if reported is None and process.is_alive():
                continue
            if reported is not None:
                return WorkerFailure(f"tensor-parallel worker {rank} (pid {process.pid}) failed while {stage}:\n"
                                     f"{reported.rstrip()}")
            code = process.exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            checked_in = self.store is not None and _has_key(self.store, ready_key(rank))
            if not checked_in:
                return WorkerFailure(f"tensor-parallel worker {rank} (pid {process.pid}) {how} before it started, "
                                     f"while importing the main module (its error is printed above). "
                                     f"{MAIN_GUARD_ADVICE}")
            return WorkerFailure(f"tensor-parallel worker {rank} (pid {process.pid}) {how} while {stage}.")
        return None

    def check(self, stage: str) -> None:
        """Raise WorkerFailure if a worker died or raised, or an earlier stage failed."""
        if self._failure is None and (self.broken or self.dead()):
            self._record(self.failure(stage))
        if self._failure is not None:
            raise WorkerFailure(self._failure)
        if self.broken:
            raise WorkerFailure("an earlier stage failed, and the tensor-parallel ranks are out of step: close this "
                                "engine and make a new one.")

    def _record(self, failure: WorkerFailure | None) -> None:
        if failure is not None:
            self.broken = True
            if self._failure is None:
                self._failure = str(failure)

    @contextmanager
    def watch(self, stage: str) -> Iterator[None]:
        """Run a stage that talks to the workers: if it fails because a worker died or raised, raise that
        worker's error instead. Any failure leaves the ranks out of step (``broken``): the other workers, which may
        wait in a collective for ever, are killed at once."""
        self._stage = stage
        try:
            yield
        except BaseException as exc:
            self.broken = True
            if self._failure is None:
                self._record(self._wait_for_failure(stage))
            self.stop(None)
            if self._failure is not None:
                raise WorkerFailure(self._failure) from exc
            raise

    def _wait_for_failure(self, stage: str) -> WorkerFailure | None:
        deadline = time.monotonic() + (_DEATH_GRACE_SECONDS if self.processes else 0)
        while True:
            failure = self.failure(stage)
            if failure is not None or time.monotonic() > deadline:
                return failure
            time.sleep(_POLL_SECONDS)

    def wait_until_ready(self, timeout: datetime.timedelta = STEP_TIMEOUT) -> None:
        """Until every worker has checked in on the store (it then joins the group at once)."""
        deadline = time.monotonic() + timeout.total_seconds()
        pending = set(range(1, len(self.processes) + 1))
        while pending:
            if self.dead():
                self.check("starting")
            pending = {rank for rank in pending if not _has_key(self.store, ready_key(rank))}
            if pending and time.monotonic() > deadline:
                self.broken = True
                raise WorkerFailure(f"tensor-parallel workers {sorted(pending)} did not start within {timeout}.")
            if pending:
                time.sleep(_POLL_SECONDS)

    def _watch(self) -> None:
        while not self._closing:
            if self.dead():
                if not self._closing:
                    logger.error("a tensor-parallel worker died: aborting the process group")
                    self._record(self.failure(self._stage))
                    try:
                        dist.distributed_c10d._abort_process_group()
                    except Exception as exc:  # an older torch: the step waits for the group's timeout
                        logger.warning("could not abort the process group: %s", exc)
                return
            time.sleep(0.5)

    # -- shutdown -------------------------------------------------------------------------------------------------
    def stop(self, control) -> None:
        """Tell the workers to exit (when the ranks are in step), else kill them; reap every one."""
        self._closing = True
        if control is not None and not self.broken and not self.dead():
            try:
                dist.broadcast_object_list([("exit", None)], src=0, group=control)
                dist.barrier(group=control)  # every rank has the message before the group goes
            except Exception as exc:
                logger.warning("tensor-parallel workers did not take the exit message (%s): killing them", exc)
        for process in self.processes:
            process.join(timeout=10 if not self.broken else 0.5)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


def _has_key(store: dist.Store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:
        return False
