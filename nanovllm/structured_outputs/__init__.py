"""Structured outputs: grammars compiled off the step loop, per-request matchers, token bitmasks for the sampler.

A request with ``SamplingParams.structured_outputs`` gets a ``RequestGrammar`` per sample. Its grammar compiles
in the backend's worker thread (cached by the constraint's key); the engine holds the request back until it is
ready. Each step the sampler's host side fills the request's row of a token bitmask from the matcher, the
sampler masks the logits on the device (``nanovllm.layers.sampler.apply_token_bitmask``), and the sampled token
advances the matcher. The library is xgrammar (see docs/benchmarks.md for why), imported only when a
constrained request arrives.
"""

from __future__ import annotations

from nanovllm.structured_outputs.backend import GrammarBackend, RequestGrammar, bitmask_width

__all__ = ["GrammarBackend", "RequestGrammar", "bitmask_width"]
