"""Fixtures of the server tests: a tiny chat model, and real server processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

REPO_ROOT = Path(__file__).parents[2]  # not resolved: run the checkout the tests come from
# small pool, small blocks: 32 requests fit, and usage moves visibly
ENGINE_FLAGS = ["--kvcache-block-size", "16", "--num-kvcache-blocks", "256", "--max-num-seqs", "64"]


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    from tests.server.model import save_tiny_chat_model
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `python -m nanovllm.server.serve` that Linux sends SIGTERM when the test process dies (PR_SET_PDEATHSIG), so a
# suite killed mid-run leaves no server behind (the fixtures stop theirs only on a normal exit)
_SERVE_WHILE_THE_PARENT_LIVES = (
    "import ctypes, runpy, signal, sys\n"
    "if sys.platform == 'linux':\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "runpy.run_module('nanovllm.server.serve', run_name='__main__', alter_sys=True)\n"
)


class ServerProcess:
    """``python -m nanovllm.server.serve`` in a child process, waited for until /health answers."""

    def __init__(self, model: str | None, *flags: str, env: dict | None = None, startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="nanovllm-server-", suffix=".log", delete=False)
        python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        child_env = dict(os.environ, PYTHONPATH=python_path, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                         **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE_WHILE_THE_PARENT_LIVES, *([model] if model else []), "--port", str(self.port),
             "--no-access-log",
             "--log-level", "warning", *flags],
            cwd=REPO_ROOT, env=child_env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not become healthy:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int | None:
        self.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(chat_model):
    """The shared server of the API tests (session-wide: starting one takes seconds)."""
    proc = ServerProcess(chat_model, *ENGINE_FLAGS)
    yield proc
    proc.stop()


def metric_values(url: str) -> dict[str, float]:
    """Samples of /metrics as {'name{labels}': value}, labels without model_name."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if not line.startswith("nanovllm:"):
            continue
        key, value = line.rsplit(" ", 1)
        if "{" in key:
            name, labels = key[:-1].split("{", 1)
            labels = ",".join(p for p in labels.split(",") if not p.startswith("model_name="))
            key = f"{name}{{{labels}}}" if labels else name
        values[key] = float(value)
    return values


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval)


def assert_error(response: httpx.Response, status: int, param: str | None = "any", code: str | None = "any",
                 words: tuple = ()) -> dict:
    """The response is an error in OpenAI's shape with this status; param and code checked unless "any", and
    each of ``words`` appears in the message. Returns the error object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    for word in words:
        assert word in error["message"], error
    return error


def wait_idle(async_llm, tries: int = 300) -> None:
    """Until an AsyncLLM's engine thread has applied every command (an abort is asynchronous) and holds no
    request, polling every 10 ms at most ``tries`` times; the caller asserts what it expects afterwards."""
    async def settle():
        for _ in range(tries):
            if async_llm.num_in_flight == 0 and not async_llm.engine.has_unfinished_requests():
                return
            await asyncio.sleep(0.01)
    asyncio.run(settle())
