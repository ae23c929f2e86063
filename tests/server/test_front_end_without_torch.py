"""The server's front end (HTTP, tokenizer, detokenizer) never imports torch: only the engine core process does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).parents[2]

# what `nanovllm serve` imports before and while it serves (the engine core process imports the rest)
FRONT_END_IMPORTS = """
import sys
import nanovllm
import nanovllm.cli
import nanovllm.server.serve
import nanovllm.server.app
import nanovllm.engine.core_client
from nanovllm import SamplingParams, RequestOutput, StructuredOutputsParams
from nanovllm.config import EngineConfig
from nanovllm.engine_args import add_engine_args
print(sorted(name for name in sys.modules if name == "torch" or name.startswith("torch.")))
"""


def run_python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_front_ends_imports_leave_torch_out():
    assert run_python(FRONT_END_IMPORTS) == "[]"


def test_the_package_root_still_gives_the_engine():
    out = run_python("import sys\nfrom nanovllm import LLM, SamplingParams\nimport nanovllm\n"
                     "print(LLM.__module__, SamplingParams.__module__, 'torch' in sys.modules, "
                     "'LLM' in dir(nanovllm))")
    assert out == "nanovllm.llm nanovllm.sampling_params True True"


def test_an_unknown_name_of_the_package_root_is_an_attribute_error():
    out = run_python("import nanovllm\ntry:\n    nanovllm.NoSuchThing\nexcept AttributeError as e:\n    print(e)")
    assert "NoSuchThing" in out


def test_a_serving_front_end_has_no_torch_loaded(chat_model):
    """After a request went through it (tokenized, detokenized), the front end process maps no libtorch. A server
    of its own: the shared one may have had a structured-outputs request, whose xgrammar imports torch."""
    from tests.server.conftest import ENGINE_FLAGS, ServerProcess

    server = ServerProcess(chat_model, *ENGINE_FLAGS)
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert "libtorch" not in Path(f"/proc/{server.proc.pid}/maps").read_text()
        core_pids = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
        assert any("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in core_pids)  # the engine core's
    finally:
        assert server.stop() == 0
