from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels run under the CPU interpreter; it must be chosen before any kernel module
# is imported, whichever test folder imports one first.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
except ImportError:
    pass
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The oracle (transformers) runs in float32: so does the CPU engine here, also where the CPU would pick bf16.
os.environ.setdefault("NANOVLLM_CPU_DTYPE", "float32")
# cpu_int8's steps of many rows: fbgemm here, the same path on every CPU; the tests of the compiled tiles (the
# default where the CPU has AVX512-VNNI) ask for them by name
os.environ.setdefault("NANOVLLM_CPU_INT8_TILES", "0")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    from tests.helpers import save_tiny_model
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    from tests.helpers import save_tiny_model
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tiny-qwen3-moe"))
