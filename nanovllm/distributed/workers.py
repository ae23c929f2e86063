"""Tensor-parallel execution: rank 0 drives, the other ranks replay each step it broadcasts.

Two ways to start the ranks:
- ``LLM(..., tensor_parallel_size=N)`` on one machine: rank 0 is this process and spawns N-1 workers; they
  meet on a free TCP port of 127.0.0.1 (no fixed port, no shared-memory name).
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

import atexit
import datetime
import logging
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

STEP_TIMEOUT = datetime.timedelta(minutes=30)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_for(config, local_rank: int) -> torch.device:
    if config.is_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _init_group(config, rank: int, world_size: int, init_method: str):
    """Join the tensor-parallel group; returns the control group (gloo) that carries each step's message.

    Messages go over the host (TCP), not through the GPU: a message sent on the NCCL group would queue behind the
    step running on rank 0's device, and a worker could not prepare the next step while its device computes.
    """
    backend = "nccl" if config.is_cuda else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=STEP_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=STEP_TIMEOUT) if config.is_cuda else dist.group.WORLD


def _build_runner(config, hf_config, model_path: str, max_model_len: int, device: torch.device):
    from nanovllm.engine.model_runner import ModelRunner

    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    return ModelRunner(config, hf_config, model_path, max_model_len, rank=dist.get_rank(), device=device)


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


def worker_main(rank: int, world_size: int, init_method: str, config, hf_config, model_path: str,
                max_model_len: int, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    control = _init_group(config, rank, world_size, init_method)
    runner = None
    try:
        runner = _build_runner(config, hf_config, model_path, max_model_len, _device_for(config, rank))
        _serve_steps(runner, control)
    finally:
        if runner is not None:
            runner.close()  # CUDA graphs hold NCCL work: free them before the group
        control = None  # see TensorParallelRunner.close
        dist.destroy_process_group()


class TensorParallelRunner:
    """Rank 0's runner: same interface as ModelRunner (run, num_kvcache_blocks, close)."""

    supports_prompt_logprobs = True

    def __init__(self, config, source, max_model_len: int):
        self.world_size = config.tensor_parallel_size
        self.processes: list = []
        if config.is_cuda and torch.cuda.device_count() < self.world_size and "WORLD_SIZE" not in os.environ:
            raise ValueError(f"tensor_parallel_size {self.world_size} needs {self.world_size} GPUs; "
                             f"torch sees {torch.cuda.device_count()}.")
        if "WORLD_SIZE" in os.environ:  # started by torchrun
            world = int(os.environ["WORLD_SIZE"])
            if world != self.world_size:
                raise ValueError(f"tensor_parallel_size {self.world_size} does not match torchrun's WORLD_SIZE {world}.")
            rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
            self.control = _init_group(config, rank, world, "env://")
            device = _device_for(config, local_rank)
            if rank != 0:
                runner = _build_runner(config, source.hf_config, source.path, max_model_len, device)
                _serve_steps(runner, self.control)
                runner.close()
                self.control = None  # no process group may outlive destroy_process_group (see close)
                dist.destroy_process_group()
                sys.exit(0)
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            for rank in range(1, self.world_size):
                process = ctx.Process(target=worker_main, daemon=True, args=(
                    rank, self.world_size, init_method, config, source.hf_config, source.path, max_model_len,
                    os.getpid()))
                process.start()
                self.processes.append(process)
            self.control = _init_group(config, 0, self.world_size, init_method)
            device = _device_for(config, 0)
        self.runner = _build_runner(config, source.hf_config, source.path, max_model_len, device)
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.disable_slice_sampling = False  # tests and benchmarks: gather the logits on rank 0 instead
        self.closed = False
        atexit.register(self.close)

    def run(self, seqs):
        return self.launch(seqs).result()

    def launch(self, seqs, after=None):
        """Send the step to the workers, then start it here; ``after``: as ``ModelRunner.launch``."""
        for process in self.processes:
            if not process.is_alive():
                raise RuntimeError(f"a tensor-parallel worker (pid {process.pid}) died with exit code "
                                   f"{process.exitcode}; the engine cannot continue.")
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
        dist.broadcast_object_list([message], src=0, group=self.control)
        return self.runner.launch(seqs, prompt_logprob_seqs, after=after, source_rows=source_rows,
                                  slice_sampling=slice_sampling)

    def _slice_sampling(self, seqs, after):
        """(temperatures, seeds) when every rank can sample on its own slice of the vocabulary, else None.

        Only on GPUs (the noise comes from the sampling kernel's per-row seeds) and when the step needs nothing
        but temperatures; then no logits are gathered on rank 0 and no tokens broadcast from it.
        """
        from nanovllm.engine.batch import needs_sample
        from nanovllm.engine.sampling import temperature_only_rows
        if self.runner.seed_source is None or self.disable_slice_sampling:
            return None
        sampled = seqs if after is not None else [s for s in seqs if needs_sample(s)]
        return temperature_only_rows(sampled, self.runner.seed_source)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.runner.close()
        try:
            if all(p.is_alive() for p in self.processes):
                dist.broadcast_object_list([("exit", None)], src=0, group=self.control)
                dist.barrier(group=self.control)
            for process in self.processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
        finally:
            # A group object still referenced after destroy_process_group is destructed at interpreter exit,
            # where gloo's threads can abort the process ("terminate called without an active exception").
            self.control = None
            if dist.is_initialized():
                dist.destroy_process_group()
