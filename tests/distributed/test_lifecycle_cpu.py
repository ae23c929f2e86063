"""Tensor-parallel engines one after another in one process, and workers that die: errors within seconds, never
a hang, no process left. Each case runs in a subprocess (lifecycle_script.py), so a hang fails its timeout."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run_script(args: list[str], timeout: float, cwd: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    start = time.monotonic()
    # its own session, so that a timeout takes its workers down with it
    process = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, cwd=cwd, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{args[0]} hung (killed after {timeout} s):\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), time.monotonic() - start


def test_dropped_tp2_engine_then_tp1_and_tp2_engines(tiny_qwen3, tmp_path):
    result, _ = run_script([os.path.join(HERE, "lifecycle_script.py"), "engines", tiny_qwen3,
                            str(tmp_path / "unused")], timeout=240)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_a_script_without_the_main_guard_fails_fast_naming_it(tiny_qwen3, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text("from nanovllm import LLM\n"
                      f"llm = LLM({tiny_qwen3!r}, tensor_parallel_size=2, kvcache_block_size=16, "
                      "num_kvcache_blocks=32)\n"
                      "print('GENERATED', llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids)\n")
    result, seconds = run_script([str(script)], timeout=60, cwd=str(tmp_path))
    assert result.returncode != 0 and "GENERATED" not in result.stdout
    assert "WorkerFailure" in result.stderr and 'if __name__ == "__main__":' in result.stderr, result.stderr[-3000:]
    assert seconds < 60


@pytest.fixture(scope="module")
def killed(tiny_qwen3, tmp_path_factory) -> dict:
    """One subprocess, three engines: worker 1 kills itself while loading weights, then (next engine) in a step,
    then (the last) raises while loading."""
    marker = tmp_path_factory.mktemp("killed") / "killed_at"
    result, _ = run_script([os.path.join(HERE, "lifecycle_script.py"), "kill", tiny_qwen3, str(marker)], timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT="))
    return json.loads(line[len("RESULT="):])


def test_a_worker_killed_while_loading_weights_fails_the_constructor_within_seconds(killed):
    outcome = killed["loading"]
    assert not outcome["engine_built"]
    assert "worker 1" in outcome["error"] and "signal 9" in outcome["error"] and "loading" in outcome["error"]
    assert outcome["seconds"] < 10
    assert outcome["children"] == [] and not outcome["group"], "no worker and no process group is left"


def test_a_worker_killed_in_a_step_fails_the_step_within_seconds(killed):
    outcome = killed["step"]
    assert outcome["engine_built"]
    assert "worker 1" in outcome["error"] and "signal 9" in outcome["error"] and "step" in outcome["error"]
    assert outcome["seconds"] < 10
    assert outcome["children"] == [] and not outcome["group"], "no worker and no process group is left"


def test_a_worker_that_raises_is_named_with_its_own_error(killed):
    outcome = killed["raising"]
    assert not outcome["engine_built"]
    assert "worker 1" in outcome["error"] and "loading" in outcome["error"]
    assert "ValueError: a fault in worker 1's weight loader" in outcome["error"], "the worker's own traceback"
    assert outcome["seconds"] < 10
    assert outcome["children"] == [] and not outcome["group"]
