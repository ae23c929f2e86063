"""Engine arguments as command-line flags: one flag per EngineConfig field, shared by every subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from nanovllm.config import DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS, EngineConfig

HELP = {
    "tokenizer": "tokenizer folder (default: the model's own)",
    "max_model_len": "longest prompt + completion in tokens (default: the model's limit)",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one engine step (longer prompts are prefilled in chunks; default "
                              f"8192 on CUDA, {DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS} on the CPU)",
    "kvcache_block_size": "tokens per KV-cache block (a power of two; default 256 on CUDA, 16 on the CPU)",
    "num_kvcache_blocks": "KV-cache pool size in blocks (default: from memory)",
    "kv_cache_memory_bytes": "KV-cache pool size in bytes (default on the CPU: what max_num_seqs requests of "
                             "max_model_len tokens can hold, at most 16,384 tokens or one max_model_len, and at "
                             "most 2 GiB; its pages are taken as they are first written)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (CUDA)",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "prefix_caching_hash_algo": "hash of the prefix cache's blocks: xxh64 (default) or sha256 (as vLLM's); a hit "
                                "also compares the tokens and the block before, so a collision costs a miss",
    "dtype": "auto (bfloat16 on CUDA, and on CPUs with AVX512-BF16 or AMX; else float32; float32 under "
             "--cpu-int8, --cpu-fp16 or an int8 KV cache), float32, float16 or bfloat16",
    "device": "cpu or cuda (default: cuda when available)",
    "seed": "random seed of sampling and of dummy weights",
    "enforce_eager": "no CUDA graphs (as --cudagraph-mode none)",
    "cudagraph_mode": "CUDA graphs (vLLM's modes): full_and_piecewise (decode-only steps replay whole graphs, "
                      "other steps of up to 8192 tokens graphs of the layers between their attention calls), "
                      "full_decode_only, piecewise (every step) or none",
    "load_format": "auto, safetensors, gguf or dummy (random weights from config.json)",
    "tensor_parallel_size": "number of GPUs (or CPU processes) to split the model across",
    "disable_custom_all_reduce": "tensor parallelism on CUDA: all-reduce with NCCL only, not with the engine's "
                                 "own peer-to-peer all-reduce of small (decode) tensors",
    "attention_backend": "torch or triton (default: triton on CUDA, torch on the CPU)",
    "async_scheduling": "plan and launch each step while the one before still runs, so the device never waits "
                        "for the host (default: on with CUDA)",
    "cpu_fp16_decode": "deprecated: the same as --cpu-fp16",
    "cpu_fp16": "CPU, float32 models: the linear layers and the LM head multiply float16 weights (float32 "
                "activations and sums, fbgemm): 2-3x faster one-request steps and ~1.3x at 64 requests, half "
                "the weight memory, float16 weight rounding (greedy tokens may differ from float32's)",
    "cpu_int8": "CPU, float32 models: the linear layers and the LM head multiply int8 weights (per output "
                "channel) by int8-quantized activations (a scale per 32 values; per row in fbgemm's steps of "
                "3+ rows on CPUs without AVX512-VNNI): about 2x faster matmuls, a quarter of the weight bytes, "
                "int8 rounding (greedy tokens differ from float32's more than with --cpu-fp16); the KV cache "
                "defaults to float16",
    "kv_cache_dtype": "auto (the model's dtype; float16 under --cpu-int8), float32, float16, bfloat16, int8 or "
                      "fp8 (= fp8_e4m3); fp8 anywhere: e4m3 (scale 1.0, saturating at 448), "
                      "v_scale, else 1.0), twice a 16-bit cache's tokens in the same pool; other dtypes than the "
                      "model's: CPU only (e.g. float16 under a float32 model: twice the tokens in the same pool, "
                      "float16 rounding; int8: float32 models with the compiled CPU ops, a scale per token and KV "
                      "head, 1.9x float16's tokens in the same pool, coarser rounding)",
    "speculative_config": "speculative decoding as JSON, vLLM's keys: '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}' "
                          "(drafts from the request's own earlier tokens, verified in one step; the same tokens)",

    "quantization": "fp8: a float checkpoint's linear weights become e4m3 at load (a scale per output channel) "
                    "and multiply e4m3 activations (a scale per token): torch._scaled_mm on CUDA (Hopper), a "
                    "dequantized reference elsewhere. An fp8 checkpoint (quantization_config quant_method fp8, "
                    "128x128 blocks, as Qwen3-*-FP8) is read as it is, whatever this says",
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows each flag's default, unless its text already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        nothing = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not action.option_strings or "default" in text or nothing or text == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def add_engine_args(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model" and not include_model:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        default = field.default
        if kind is bool or bool in typing.get_args(kind):  # bool | None: None = decided by the engine
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=HELP.get(field.name))
            continue
        base = next((t for t in (int, float, str) if t is kind or t in typing.get_args(kind)), str)
        group.add_argument(flag, type=base, default=default,
                           help=HELP.get(field.name, "a local Hugging Face folder or .gguf file "
                                         "(default: the embedded SmolLM2-135M-Instruct)"))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments of parsed flags, as keyword arguments for LLM(...)."""
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
