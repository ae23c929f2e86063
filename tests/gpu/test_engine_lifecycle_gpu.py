"""Engines one after another in one process on a GPU machine. Run with `pytest -m gpu`."""

import json
import os
import subprocess
import sys

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(3, 300)), list(range(3, 40))]
CUDA_KW = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.5, max_num_batched_tokens=512)


def _pool_of_a_cuda_engine_in_a_fresh_process(model: str) -> int:
    code = ("import json, sys\nfrom nanovllm import LLM\n"
            f"llm = LLM(sys.argv[1], **{CUDA_KW!r})\nprint('BLOCKS=' + json.dumps(llm.num_kvcache_blocks))\n")
    result = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("BLOCKS="))[7:])


def test_a_cuda_engine_after_a_dropped_cpu_engine_gets_its_full_pool(tiny_qwen3):
    fresh = _pool_of_a_cuda_engine_in_a_fresh_process(tiny_qwen3)
    cpu = LLM(tiny_qwen3, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64)
    expected = [o.token_ids for o in cpu.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del cpu
    gpu = LLM(tiny_qwen3, **CUDA_KW)
    try:
        assert gpu.num_kvcache_blocks >= 0.99 * fresh, (gpu.num_kvcache_blocks, fresh)
        assert [o.token_ids for o in gpu.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    finally:
        gpu.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_tp2_worker_killed_mid_generate_fails_it_within_seconds(tiny_qwen3):
    """NCCL does not notice a dead peer: the watchdog aborts the group, and the blocked step fails."""
    import threading
    import time

    from nanovllm.distributed.worker_set import WorkerFailure

    llm = LLM(tiny_qwen3, tensor_parallel_size=2, dtype="float32", kvcache_block_size=16, num_kvcache_blocks=4096,
              enforce_eager=True)
    worker = llm.runner.processes[0]
    killed_at = []

    def kill_soon():
        time.sleep(3)
        killed_at.append(time.monotonic())
        worker.kill()

    threading.Thread(target=kill_soon, daemon=True).start()
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    with pytest.raises(WorkerFailure, match="worker 1"):
        for _ in range(10_000):  # long enough to be running when the worker dies
            llm.generate([list(range(3, 200))] * 64, params, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 10
    llm.close()
    assert not worker.is_alive()
