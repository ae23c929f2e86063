"""nanovllm: a fast, readable LLM inference engine with vLLM's interface."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The package root imports nothing heavy: the server's front end (HTTP, tokenizer, detokenizer) runs without
# torch, and `import nanovllm` must not load it. Each name is imported from its module when first used.
_LAZY = {
    "LLM": "nanovllm.llm",
    "SamplingParams": "nanovllm.sampling_params",
    "RequestOutputKind": "nanovllm.sampling_params",
    "StructuredOutputsParams": "nanovllm.sampling_params",
    "RequestOutput": "nanovllm.outputs",
    "CompletionOutput": "nanovllm.outputs",
}

if TYPE_CHECKING:
    from nanovllm.llm import LLM
    from nanovllm.outputs import CompletionOutput, RequestOutput
    from nanovllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "StructuredOutputsParams",
    "RequestOutputKind",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
