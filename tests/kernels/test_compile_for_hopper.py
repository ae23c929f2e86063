"""The engine's Triton kernels compile for Hopper (sm_90) at the launchers' configurations, on any machine:
the CPU interpreter runs the other kernel tests, and lets through what only the compiler rejects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _has_nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.skipif(not _has_nvidia_backend(), reason="this triton has no NVIDIA backend to compile with")
def test_the_kernels_compile_for_hopper():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "tests.kernels.hopper_compile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, "\n".join(line for line in lines if line.startswith("FAILED")) + done.stderr[-3000:]
    assert len([line for line in lines if line.startswith("ok: ")]) >= 26, done.stdout
