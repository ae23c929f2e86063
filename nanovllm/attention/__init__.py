"""Attention metadata and the scoped forward context, the backend interface (backend.py), the device-agnostic
backends (triton, torch) and the oracle they are tested against (reference.py). The CPU's backend is in
nanovllm/platforms/cpu/attention.py."""
