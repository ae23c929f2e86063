"""A server the tests start ends with the test process, even when that process is killed (no orphan servers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.server.conftest import ENGINE_FLAGS, REPO_ROOT

# a stand-in for a test process: starts a server as the fixtures do, prints its pid, then waits to be killed
PARENT = """
import sys, time
from tests.server.conftest import ServerProcess
server = ServerProcess(sys.argv[1], *sys.argv[2:])
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended: only its parent has not reaped it yet
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_killed_test_process_takes_its_server_down(chat_model):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, chat_model, *ENGINE_FLAGS], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    server_pid = None
    try:
        server_pid = int(parent.stdout.readline())
        assert _alive(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid), f"the server {server_pid} outlived the process that started it"
    finally:
        parent.kill()
        parent.wait()
        if server_pid is not None and _alive(server_pid):  # the failure above: end the orphan
            os.kill(server_pid, signal.SIGKILL)
