"""Kernels: Triton kernels for the paged KV cache (store, prefill and decode attention, sampling; each of those
modules imports triton), and the CPU's compiled decode ops (cpu_ops)."""
