from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    from tests.helpers import save_tiny_model
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))
