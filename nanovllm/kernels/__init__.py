"""Kernels: Triton kernels for the paged KV cache (store, prefill and decode attention, sampling; each of those
modules imports triton). The CPU's compiled ops are in nanovllm/platforms/cpu/cpu_ops.py (cpu_ops here is that
module under its old name)."""
