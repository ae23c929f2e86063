"""One-line descriptions of an engine for its start: what is being loaded, then the KV pool it got."""

from __future__ import annotations

from nanovllm.config import EngineConfig


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def loading_line(config: EngineConfig) -> str:
    """``Loading <model> on <device> (<dtype>)...``: said before the weights are read."""
    model = config.model or "the embedded SmolLM2-135M-Instruct (Q4_1 GGUF)"
    extras = [flag for flag in ("cpu_int8", "cpu_fp16") if getattr(config, flag) and not config.is_cuda]
    parallel = f", tensor parallel x{config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else ""
    quantized = f", {', '.join(extras)}" if extras else ""
    return f"Loading {model} on {config.device} ({_dtype_name(config.torch_dtype)}{quantized}{parallel})..."


def kv_cache_line(engine) -> str:
    """The KV pool's size and token capacity, and the limits it was sized for."""
    config = engine.config
    runner = getattr(engine.runner, "runner", engine.runner)  # tensor parallel: rank 0's own runner
    per_block = getattr(runner, "kv_bytes_per_block", None)
    blocks, block_size = engine.num_kvcache_blocks, config.kvcache_block_size
    size = f"{_bytes(blocks * per_block)} " if per_block else ""
    per_rank = " per rank" if config.tensor_parallel_size > 1 and per_block else ""
    return (f"KV cache: {size}{_dtype_name(config.kv_torch_dtype)}{per_rank}, {blocks * block_size:,} tokens "
            f"({blocks:,} blocks of {block_size}); max_model_len {engine.max_model_len:,}, "
            f"max_num_seqs {config.max_num_seqs}")
