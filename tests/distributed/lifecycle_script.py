"""Tensor-parallel engines' lifecycle in one process, run by test_lifecycle_cpu.py (a subprocess each, so that a
hang is a timeout there and not a hung suite).

usage: lifecycle_script.py SCENARIO MODEL MARKER_FILE
  engines: a TP=2 engine dropped without close() (kept alive by a reference cycle), then a TP=1 engine that may
           make no collective call, then a TP=2 engine again, dropped without a cycle; prints OK
  kill: three TP=2 engines; worker 1 of the first kills itself (SIGKILL) while loading its weights, that of the
        second in its third step, that of the third raises while loading, each after writing the time to
        MARKER_FILE.<stage>; prints the driver's errors as JSON

The patches below sit at module level: a spawned worker imports this module (as __mp_main__) too, so they act
there, where the function being patched runs; a worker reads the stage to die in from its environment.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time

import nanovllm.engine.model_runner as model_runner

SCENARIO, MODEL, MARKER = sys.argv[1:4]
GREEDY_KW = dict(temperature=0, max_tokens=6, ignore_eos=True)
KW = dict(kvcache_block_size=16, num_kvcache_blocks=32, max_num_batched_tokens=64)
PROMPTS = [[5, 6, 7], list(range(3, 40)), list(range(100, 121))]


def _in_worker_dying_at(stage: str) -> bool:
    return multiprocessing.current_process().name != "MainProcess" and os.environ.get("DIE_WHILE") == stage


def _kill_myself(stage: str) -> None:
    with open(f"{MARKER}.{stage}", "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


_load_weights = model_runner.load_weights
_launch = model_runner.ModelRunner.launch
_calls = [0]


def _dying_load_weights(*args, **kwargs):
    if _in_worker_dying_at("loading"):
        _kill_myself("loading")
    if _in_worker_dying_at("raising"):
        with open(f"{MARKER}.raising", "w") as f:
            f.write(str(time.time()))
        raise ValueError("a fault in worker 1's weight loader")
    return _load_weights(*args, **kwargs)


def _dying_launch(self, *args, **kwargs):
    _calls[0] += 1
    if _calls[0] == 3 and _in_worker_dying_at("step"):
        _kill_myself("step")
    return _launch(self, *args, **kwargs)


if SCENARIO == "kill":
    model_runner.load_weights = _dying_load_weights
    model_runner.ModelRunner.launch = _dying_launch


def tokens(llm) -> list[list[int]]:
    from nanovllm import SamplingParams
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY_KW), use_tqdm=False)]


def engines() -> None:
    import torch
    import torch.distributed as dist

    from nanovllm import LLM

    threads = torch.get_num_threads()
    dropped = LLM(MODEL, tensor_parallel_size=2, **KW)
    dropped_tokens = tokens(dropped)
    dropped.cycle = dropped  # `del` alone does not collect it: its group and worker stay alive
    old_worker = dropped.runner.processes[0]
    del dropped
    assert dist.is_initialized() and old_worker.is_alive()

    def no_collectives(*args, **kwargs):
        raise AssertionError("a TP=1 engine made a collective call")

    names = ["all_reduce", "broadcast", "broadcast_object_list", "barrier", "gather", "all_gather_into_tensor"]
    saved = {name: getattr(dist, name) for name in names}
    for name in names:
        setattr(dist, name, no_collectives)
    try:
        with LLM(MODEL, **KW) as single:
            expected = tokens(single)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    assert dropped_tokens == expected
    assert old_worker.is_alive(), "the dropped engine's group existed all along"

    again = LLM(MODEL, tensor_parallel_size=2, **KW)  # collects the dropped engine, which shuts down
    assert not old_worker.is_alive()
    assert tokens(again) == expected
    worker = again.runner.processes[0]
    del again  # no cycle: its worker exits and its group goes at once
    worker.join(timeout=10)
    assert not worker.is_alive() and not dist.is_initialized()
    assert multiprocessing.active_children() == []
    assert torch.get_num_threads() == threads, "rank 0's share of the CPU is given back"
    print("OK", flush=True)


def killed(stage: str) -> dict:
    import torch.distributed as dist

    from nanovllm import LLM
    from nanovllm.distributed.worker_set import WorkerFailure

    os.environ["DIE_WHILE"] = stage  # read by the worker spawned next
    llm = None
    try:
        llm = LLM(MODEL, tensor_parallel_size=2, **KW)
        tokens(llm)
        error = None
    except WorkerFailure as exc:
        error = str(exc)
    raised_at = time.time()
    if llm is not None:
        llm.close()
    with open(f"{MARKER}.{stage}") as f:
        killed_at = float(f.read())
    return {"error": error, "seconds": raised_at - killed_at, "engine_built": llm is not None,
            "children": [p.pid for p in multiprocessing.active_children()], "group": dist.is_initialized()}


if __name__ == "__main__":
    if SCENARIO == "engines":
        engines()
    else:
        print("RESULT=" + json.dumps({stage: killed(stage) for stage in ("loading", "step", "raising")}), flush=True)
