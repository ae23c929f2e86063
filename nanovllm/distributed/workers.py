"""Tensor-parallel execution: rank 0 drives, the other ranks replay each step it broadcasts.

Two ways to start the ranks:
- ``LLM(..., tensor_parallel_size=N)`` on one machine: rank 0 is this process and spawns N-1 workers; they
  meet on rank 0's store, on a free TCP port of 127.0.0.1 (no fixed port, no shared-memory name). Rank 0 watches
  them at every stage (worker_set.py): a worker that dies or raises is named, with its own error, within seconds.
  The engine creates its process group and destroys it on close (or when it is garbage); it never joins a group
  it did not create.
- under ``torchrun --nproc-per-node N [--nnodes M ...] script.py``: every process runs the same script; the
  process with RANK 0 returns from ``LLM(...)`` and drives, the others serve steps inside the constructor and
  exit when the driver closes the engine.

Each step, rank 0 broadcasts ("run", ([Sequence], prompt-logprob rows, source rows, slice sampling)) over a host
(gloo) group — a Sequence pickles to what a worker needs (the token list while prefilling, the last token in
decode) — and every rank runs the same forward. On GPUs, a step whose rows need only a temperature is sampled by
every rank on its slice of the vocabulary (rank 0 sends each row's temperature and noise seed): the ranks exchange
one (score, id) winner per row. Otherwise the logits are gathered on rank 0, which samples alone; with
asynchronous scheduling it then broadcasts the sampled ids on the device. A step planned ahead names, for each
sequence, its row among the previous step's sampled ids.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.distributed.state import TensorParallel
from nanovllm.distributed.worker_set import (
    MAIN_GUARD_ADVICE,
    STEP_TIMEOUT,
    WorkerSet,
    ready_key,
    report_error,
)

logger = logging.getLogger(__name__)


def _device_for(config, local_rank: int) -> torch.device:
    if config.is_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _claim_default_group() -> None:
    """Make sure no process group exists before this engine creates its own."""
    if dist.is_initialized():
        gc.collect()  # an engine dropped without close() (in a reference cycle): its finalizer destroys its group
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process (another "
                           "tensor-parallel engine that is still open, or the program's own): a tensor-parallel "
                           "engine creates its own group and joins no other; close() the other engine first.")


def _init_group(config, rank: int, world_size: int, store: dist.Store | None):
    """Join the tensor-parallel group (through ``store``, or env:// under torchrun); returns the control group
    (gloo) that carries each step's message.

    Messages go over the host (TCP), not through the GPU: a message sent on the NCCL group would queue behind the
    step running on rank 0's device, and a worker could not prepare the next step while its device computes.
    """
    backend = "nccl" if config.is_cuda else "gloo"
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=STEP_TIMEOUT)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=STEP_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=STEP_TIMEOUT) if config.is_cuda else dist.group.WORLD


def _build_runner(config, hf_config, model_path: str, max_model_len: int, device: torch.device):
    from nanovllm.engine.model_runner import ModelRunner

    world_size = dist.get_world_size()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    tp = TensorParallel(dist.get_rank(), world_size)
    return ModelRunner(config, hf_config, model_path, max_model_len, tp=tp, device=device)


def _serve_steps(runner, control) -> None:
    """A worker's loop: launch every step rank 0 broadcasts until it says exit.

    A step planned ahead (``source_rows`` set) takes its input tokens from the step launched just before it, whose
    sampled ids rank 0 broadcast on the device (``ModelRunner.shares_sampled_tokens``).
    """
    previous = None
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        command, payload = message[0]
        if command == "exit":
            dist.barrier(group=control)  # rank 0 tears the group down only once every rank has the message
            return
        assert command == "run", command
        seqs, prompt_logprob_seqs, source_rows, slice_sampling = payload
        after = previous if source_rows is not None else None
        previous = runner.launch(seqs, prompt_logprob_seqs, after=after, source_rows=source_rows,
                                 slice_sampling=slice_sampling)


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker if the driver process disappears, instead of waiting on it forever."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_main(rank: int, world_size: int, store_port: int, config, hf_config, model_path: str,
                max_model_len: int, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=STEP_TIMEOUT)
    runner = None
    try:
        store.set(ready_key(rank), str(os.getpid()))  # imports done: rank 0 stops watching for a bad start
        control = _init_group(config, rank, world_size, store)
        runner = _build_runner(config, hf_config, model_path, max_model_len, _device_for(config, rank))
        _serve_steps(runner, control)
    except BaseException:
        report_error(store, rank)
        raise
    finally:
        if runner is not None:
            runner.close()  # CUDA graphs hold NCCL work: free them before the group
        control = None  # see TensorParallelRunner.close
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_not_importing_main() -> None:
    """In a spawned process still importing the main module (a script without the main guard), stop at once
    with the advice, rather than spawning workers of workers."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(f"a tensor-parallel LLM was created while this process (a spawned worker) was "
                           f"importing the main module. {MAIN_GUARD_ADVICE}")


class TensorParallelRunner:
    """Rank 0's runner: same interface as ModelRunner (run, launch, num_kvcache_blocks, close)."""

    supports_prompt_logprobs = True

    def __init__(self, config, source, max_model_len: int):
        self.world_size = config.tensor_parallel_size
        if config.is_cuda and torch.cuda.device_count() < self.world_size and "WORLD_SIZE" not in os.environ:
            raise ValueError(f"tensor_parallel_size {self.world_size} needs {self.world_size} GPUs; "
                             f"torch sees {torch.cuda.device_count()}.")
        _check_not_importing_main()
        _claim_default_group()
        self.control = None
        self.runner = None
        self.workers = WorkerSet([], None, abort_on_death=False)
        num_threads = torch.get_num_threads()  # rank 0 shares the CPU with its workers until it closes
        try:
            if "WORLD_SIZE" in os.environ:  # started by torchrun
                device = self._join_torchrun(config, source, max_model_len)
            else:
                device = self._spawn_workers(config, source, max_model_len)
            with self.workers.watch("loading the weights and agreeing on the KV pool size"):
                self.runner = _build_runner(config, source.hf_config, source.path, max_model_len, device)
        except BaseException:
            self.workers.broken = True
            _shutdown(self.workers, self.control, self.runner, num_threads)
            self.control = None
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.disable_slice_sampling = False  # tests and benchmarks: gather the logits on rank 0 instead
        # once: on close(), when this runner is garbage, or at interpreter exit (holds its parts, not self)
        self._finalizer = weakref.finalize(self, _shutdown, self.workers, self.control, self.runner, num_threads)

    @property
    def processes(self) -> list:
        return self.workers.processes

    def _spawn_workers(self, config, source, max_model_len: int) -> torch.device:
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, timeout=STEP_TIMEOUT,
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        processes = []
        self.workers = WorkerSet(processes, store, abort_on_death=config.is_cuda)
        for rank in range(1, self.world_size):
            process = ctx.Process(target=worker_main, daemon=True, args=(
                rank, self.world_size, store.port, config, source.hf_config, source.path, max_model_len,
                os.getpid()))
            process.start()
            processes.append(process)
        self.workers.wait_until_ready()
        with self.workers.watch("joining the process group"):
            self.control = _init_group(config, 0, self.world_size, store)
        return _device_for(config, 0)

    def _join_torchrun(self, config, source, max_model_len: int) -> torch.device:
        world = int(os.environ["WORLD_SIZE"])
        if world != self.world_size:
            raise ValueError(f"tensor_parallel_size {self.world_size} does not match torchrun's WORLD_SIZE {world}.")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
        self.control = _init_group(config, rank, world, None)
        device = _device_for(config, local_rank)
        if rank != 0:
            runner = _build_runner(config, source.hf_config, source.path, max_model_len, device)
            _serve_steps(runner, self.control)
            runner.close()
            self.control = None  # no process group may outlive destroy_process_group (see close)
            dist.destroy_process_group()
            sys.exit(0)
        return device

    def run(self, seqs):
        return self.launch(seqs).result()

    def launch(self, seqs, after=None):
        """Send the step to the workers, then start it here; ``after``: as ``ModelRunner.launch``."""
        if not self._finalizer.alive:
            raise RuntimeError("this tensor-parallel engine is closed.")
        self.workers.check("between steps")
        after = after.handle if after is not None else None
        source_rows = None
        if after is None:
            # Only rank 0's sequences know their sampling parameters: decide here which want prompt logits.
            from nanovllm.engine.sampling import wants_prompt_logprobs
            prompt_logprob_seqs = [i for i, s in enumerate(seqs) if wants_prompt_logprobs(s)]
        else:
            prompt_logprob_seqs = []
            source_rows = after.rows_of(seqs)
        slice_sampling = self._slice_sampling(seqs, after) if not prompt_logprob_seqs else None
        message = ("run", (seqs, prompt_logprob_seqs, source_rows, slice_sampling))
        with self.workers.watch("running a step"):
            dist.broadcast_object_list([message], src=0, group=self.control)
            handle = self.runner.launch(seqs, prompt_logprob_seqs, after=after, source_rows=source_rows,
                                        slice_sampling=slice_sampling)
        return _WatchedStep(handle, self.workers)

    def _slice_sampling(self, seqs, after):
        """(temperatures, seeds) when every rank can sample on its own slice of the vocabulary, else None.

        Only on GPUs (the noise comes from the sampling kernel's per-row seeds) and when the step needs nothing
        but temperatures; then no logits are gathered on rank 0 and no tokens broadcast from it.
        """
        from nanovllm.engine.batch import needs_sample
        from nanovllm.engine.sampling import temperature_only_rows
        if self.runner.seed_source is None or self.disable_slice_sampling:
            return None
        if any(s.draft_token_ids for s in seqs):  # a verify step samples several rows of a request: rank 0 does
            return None
        sampled = seqs if after is not None else [s for s in seqs if needs_sample(s)]
        return temperature_only_rows(sampled, self.runner.seed_source)

    def close(self) -> None:
        """Stop the workers and destroy the process group (idempotent)."""
        self._finalizer()
        # A group object still referenced after destroy_process_group is destructed at interpreter exit, where
        # gloo's threads can abort the process ("terminate called without an active exception").
        self.control = None


class _WatchedStep:
    """A launched step whose ``result()`` names a worker's failure (on CUDA, a step blocked on the device fails
    once the watchdog aborts the group)."""

    def __init__(self, handle, workers: WorkerSet):
        self.handle = handle
        self.seqs = handle.seqs
        self._workers = workers

    def result(self):
        with self._workers.watch("running a step"):
            output = self.handle.result()
        # the watchdog may have aborted the group under this step (CUDA): its tokens are not to be trusted
        self._workers.check("running a step")
        return output


def _shutdown(workers: WorkerSet, control, runner, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    if runner is not None:
        runner.close()  # CUDA graphs hold NCCL work: free them before the group
    try:
        workers.stop(control)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
