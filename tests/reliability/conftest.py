"""Fixtures of the reliability tests: the tiny chat model of the server tests, servers, and a process's memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    from tests.server.model import save_tiny_chat_model
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 from a thread of this process (so a test can patch its engine);
    yields the base URL, and shuts the server down (draining, then the app's shutdown) on exit."""
    import uvicorn

    from tests.server.conftest import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
