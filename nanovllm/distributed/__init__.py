"""Tensor parallelism: the process group state and the worker processes."""
