"""nanovllm: a fast, readable LLM inference engine with vLLM's interface."""

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
