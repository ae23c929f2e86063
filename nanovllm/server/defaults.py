"""The server's default limits, shared by the flags (serve.py) and the app (app.py) without either importing the
other."""

from __future__ import annotations

API_KEY_ENV = "NANOVLLM_API_KEY"
# The OpenAI API's own cap on n: any n a client may send to OpenAI is served; more would let one request fan out
# into unbounded work (each sample is a sequence of its own).
DEFAULT_MAX_N = 128
# Prompts in one /v1/completions request (each becomes an engine request): batch clients stay well under it, and
# it bounds the work one body can ask for.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
