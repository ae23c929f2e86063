"""Attention metadata, the scoped forward context, and the attention backends (torch, triton)."""
