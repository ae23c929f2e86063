"""Kernels: Triton kernels for the paged KV cache (store, prefill and decode attention, sampling) and the
decode-sized GEMM; each of those modules imports triton. The CPU's compiled ops are in nanovllm/platforms/cpu/."""
