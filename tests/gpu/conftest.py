"""Fixtures of the GPU tests."""

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each engine sizes its KV pool from the free memory: the previous test's engine must be gone first
    (CUDA graphs and compiled ops hold references in cycles, so only a collection frees it)."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
