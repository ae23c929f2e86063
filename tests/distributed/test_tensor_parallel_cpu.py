"""Tensor parallelism over gloo on the CPU: the same greedy tokens as one process; clean shutdown and failure."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.helpers import save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (1, 17, 60, 200)]


@pytest.mark.parametrize("family, overrides", [
    ("qwen3", {}),
    ("llama", {"num_key_value_heads": 1}),  # fewer KV heads than ranks: each rank holds a copy
    ("qwen2", {"tie_word_embeddings": True}),
])
def test_tp2_equals_tp1(tmp_path, family, overrides):
    path = save_tiny_model(family, tmp_path / family, **overrides)
    kwargs = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=64)
    single = LLM(path, **kwargs)
    expected = [o.token_ids for o in single.generate(prompts(), GREEDY, use_tqdm=False)]
    llm = LLM(path, tensor_parallel_size=2, **kwargs)
    try:
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == expected
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, logprobs=2)
        ours = llm.generate(prompts()[1:2], params, use_tqdm=False)[0]
        ref = single.generate(prompts()[1:2], params, use_tqdm=False)[0]
        assert [sorted(d) for d in ours.prompt_logprobs[1:]] == [sorted(d) for d in ref.prompt_logprobs[1:]]
    finally:
        llm.close()
    assert all(not p.is_alive() for p in llm.runner.processes), "workers exit on close"


def test_tp2_with_steps_planned_ahead_equals_tp1(tiny_qwen3):
    """Asynchronous scheduling across ranks (the CUDA default, forced on here): workers take a planned step's
    inputs from the sampled ids rank 0 broadcast; tokens, seeded samples and stops match one process."""
    requests = prompts() + [prompts()[2][:40]]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),  # leaves while others run on
              SamplingParams(temperature=0.7, seed=1, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    kwargs = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=64)
    expected = [o.token_ids for o in LLM(tiny_qwen3, **kwargs).generate(requests, params, use_tqdm=False)]
    llm = LLM(tiny_qwen3, tensor_parallel_size=2, async_scheduling=True, **kwargs)
    try:
        assert llm.async_scheduling
        planned = []
        original = llm.runner.launch
        llm.runner.launch = lambda seqs, after=None: planned.append(after is not None) or original(seqs, after=after)
        assert [o.token_ids for o in llm.generate(requests, params, use_tqdm=False)] == expected
        assert sum(planned) >= 5, "most decode steps were planned ahead"
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.close()
    assert all(not p.is_alive() for p in llm.runner.processes), "workers exit on close"


def test_dead_worker_is_an_error_not_a_hang(tiny_qwen3):
    llm = LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=32)
    worker = llm.runner.processes[0]
    worker.kill()
    worker.join(timeout=10)
    with pytest.raises(RuntimeError, match="worker"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.close()


def test_torchrun_launch_equals_single_process(tiny_qwen3):
    """`torchrun --nproc-per-node 2 script.py`: the env:// rendezvous path gives the same tokens."""
    import json
    import os
    import subprocess
    import sys

    prompts = [[5, 6, 7], list(range(3, 40))]
    expected = [o.token_ids for o in LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    script = os.path.join(os.path.dirname(__file__), "torchrun_script.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    # its own process group, so that a timeout takes the launcher's ranks down with it
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         script, tiny_qwen3, json.dumps(prompts)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("TOKENS="))
    assert json.loads(line[len("TOKENS="):]) == expected


def test_tp2_with_speculative_decoding_equals_tp1(tiny_qwen3):
    """Verify steps across ranks: workers get each request's draft tokens with the step; greedy tokens equal
    one process without speculation."""
    g = torch.Generator().manual_seed(5)
    passage = torch.randint(3, 380, (30,), generator=g).tolist()
    requests = [passage + passage[:12], prompts()[1]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=64)
    expected = [o.token_ids for o in LLM(tiny_qwen3, **kwargs).generate(requests, params, use_tqdm=False)]
    llm = LLM(tiny_qwen3, tensor_parallel_size=2, speculative_config={"method": "ngram", "prompt_lookup_min": 1},
              **kwargs)
    try:
        assert [o.token_ids for o in llm.generate(requests, params, use_tqdm=False)] == expected
        assert llm.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        llm.close()
