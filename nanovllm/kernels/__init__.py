"""Triton kernels for the paged KV cache (store, prefill and decode attention); each module imports triton."""
