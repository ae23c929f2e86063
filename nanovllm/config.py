"""Engine configuration: the user's engine arguments, validated, and what is derived from the model."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from nanovllm.engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

# torch's dtype of each name (as names: this module, and the server's front end that reads it for its flags,
# import without torch; EngineConfig's checks and properties import it when they run)
DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
# the KV cache also takes int8 on the CPU (a scale per token and KV head: platforms/cpu/cpu_ops.py) and fp8 e4m3
# anywhere (a scale per layer: attention/kv_fp8.py), under vLLM's names
KV_CACHE_DTYPES = {**DTYPES, "int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
PREFIX_CACHING_HASH_ALGOS = ("xxh64", "sha256")  # the keys of engine/block_manager.py's BLOCK_HASHES
QUANTIZATIONS = (None, "fp8")
# vLLM's names: decode-only steps in full graphs and the others in pieces (attention eager between them),
# decode-only steps alone in full graphs, every step in pieces, or no graph (as enforce_eager)
CUDAGRAPH_MODES = ("full_and_piecewise", "full_decode_only", "piecewise", "none")
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
# The CPU's default token budget of one step: a prefill's activations and temporaries grow with it (a step of
# 8,192 tokens held ~340 MB of them on the embedded model), and on the CPU a longer step computes no more tokens a
# second (docs/benchmarks.md, "The server under 1 GB during a prompt burst")
DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS = 1024
# The CPU pool's default also holds at most this many tokens (or one request of max_model_len, if more): 64
# requests of 256 tokens, about what 2-16 cores keep busy, without a small model's server holding GBs of cache
DEFAULT_CPU_KV_CACHE_TOKENS = 16384


@dataclass
class EngineConfig:
    """Engine arguments (the keyword names of ``LLM(...)`` and the CLI flags)."""

    model: str | None = None  # a Hugging Face folder, a .gguf file, or None for the embedded default
    tokenizer: str | None = None  # defaults to the model's own
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on CUDA, DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS on the CPU
    # tokens per KV block; None: 256 on CUDA (the decode kernel's tiles), 16 on the CPU (prefix caching shares
    # whole blocks: a chat template's system prompt of ~20-30 tokens fills one 16-token block, none of 256)
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int | None = None  # explicit pool size; else from memory (below)
    # pool size in bytes; default on the CPU: max_num_seqs x max_model_len tokens, at most
    # max(max_model_len, DEFAULT_CPU_KV_CACHE_TOKENS) tokens and 2 GiB
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may fill (CUDA only)
    enable_prefix_caching: bool = True
    # the prefix cache's block hash: xxh64 (fast) or sha256; a hit is exact with either (engine/block_manager.py)
    prefix_caching_hash_algo: str = "xxh64"
    # auto: bfloat16 on CUDA; on the CPU float32 activations, and the linear layers on 4/8-bit weight blocks where
    # the compiled ops have AVX2 or AVX512-VNNI (cpu_linear "blocks"); else bfloat16 where the CPU has native bf16
    # matmuls, else float32. An explicit float32 (or bfloat16) computes in it with float weights
    dtype: str = "auto"
    device: str | None = None  # "cuda" when available, else "cpu"
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs (cudagraph_mode "none")
    # which steps replay CUDA graphs (CUDAGRAPH_MODES; engine/cuda_graph.py, engine/piecewise_graphs.py)
    cudagraph_mode: str = "full_and_piecewise"
    load_format: str = "auto"
    tensor_parallel_size: int = 1
    # CUDA tensor parallelism: NCCL for every all-reduce, not the engine's own for small tensors
    disable_custom_all_reduce: bool = False
    attention_backend: str | None = None  # "torch" or "triton"; default triton on CUDA, torch on the CPU
    # plan step n+1 while step n runs (default: on with CUDA); the CPU gains nothing from it
    async_scheduling: bool | None = None
    # deprecated: the same as cpu_fp16 (it once meant float16 copies for steps of 1-2 tokens only)
    cpu_fp16_decode: bool = False
    # CPU, float32 models: int8 weights and int8 activations (a scale per 32 values, or per row in fbgemm's
    # steps) for the linear layers and the LM head (platforms/cpu/linear.py)
    cpu_int8: bool = False
    # CPU, float32 models: float16 weights (fbgemm) for every linear layer and the LM head (platforms/cpu/linear.py)
    cpu_fp16: bool = False
    # the KV cache's dtype: auto = the model's, but float16 under cpu_int8 and the CPU's 4/8-bit blocks (whose
    # rounding is far coarser: half the bytes a token read each step, twice the tokens in a pool; 3-7 % more
    # tokens/s at 64 requests);
    # on the CPU also float16 or bfloat16 under a float32 model, or int8 (float32 models with the compiled CPU
    # ops: a scale per token and KV head, 68 bytes a row of 64 instead of 128); fp8 / fp8_e4m3 on any device (e4m3
    # with a scale per layer, attention/kv_fp8.py: twice the tokens of a 16-bit cache); on CUDA else only the
    # model's dtype
    kv_cache_dtype: str = "auto"
    # speculative decoding, vLLM's keys: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": m,
    # "prompt_lookup_min": n}, or its JSON (the CLI); parsed into a SpeculativeConfig; None: off
    speculative_config: SpeculativeConfig | dict | str | None = None
    # fp8: the linear layers' float weights become e4m3 at load (a scale per output channel) and multiply e4m3
    # activations (a scale per token) through torch._scaled_mm on CUDA (layers/quantization/fp8.py); an fp8
    # checkpoint (its config's quantization_config) is read with its own block scales either way
    quantization: str | None = None

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

        import torch

        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        from nanovllm.platforms.cpu.settings import NO_CPU, CpuSettings
        # the machine's and the environment's CPU choices, read once (not a field: no engine argument)
        self.cpu = NO_CPU if self.device.startswith("cuda") else CpuSettings.detect()
        # torch.compile for the small elementwise ops (they compile on CUDA only: layers/compile.py) unless
        # NANOVLLM_NO_COMPILE=1; read once, as the CPU's choices are
        self.compile_small_ops = os.environ.get("NANOVLLM_NO_COMPILE") != "1"
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 256 if self.is_cuda else 16
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.is_cuda else DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS
        for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "tensor_parallel_size"):
            positive(name)
        for name in ("max_model_len", "num_kvcache_blocks", "kv_cache_memory_bytes"):
            positive(name, allow_none=True)
        if self.kvcache_block_size & (self.kvcache_block_size - 1) or not 1 <= self.kvcache_block_size <= 1024:
            raise ValueError(f"kvcache_block_size must be a power of two in [1, 1024], got {self.kvcache_block_size}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}.")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}.")
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {PREFIX_CACHING_HASH_ALGOS}, "
                             f"got {self.prefix_caching_hash_algo!r}.")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}.")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}.")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}.")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU.")
        if self.attention_backend not in (None, "torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}.")
        if self.cpu_fp16_decode:
            warnings.warn("cpu_fp16_decode is deprecated: use cpu_fp16 (float16 weights at every batch size)",
                          DeprecationWarning, stacklevel=3)
            self.cpu_fp16 = True
        for flag in ("cpu_int8", "cpu_fp16"):
            if getattr(self, flag) and (self.is_cuda or self.torch_dtype != torch.float32):
                warnings.warn(f"{flag} applies to float32 models on the CPU only; ignored here (device "
                              f"{self.device!r}, dtype {self.torch_dtype})", stacklevel=3)
        if self.kv_torch_dtype == torch.int8 and not self.is_cuda and self.torch_dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype 'int8' needs a float32 model on the CPU (the compiled attention reads "
                             f"it from float32 activations), got dtype {self.torch_dtype}: add dtype='float32'.")
        if self.is_cuda and self.kv_torch_dtype not in (self.torch_dtype, torch.float8_e4m3fn):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} differs from the model's dtype "
                             f"({self.torch_dtype}): on CUDA the KV cache takes the model's dtype ('auto') or "
                             f"'fp8'.")
        if self.model is not None:
            self.model = os.path.expanduser(str(self.model))
            if not os.path.exists(self.model):
                raise FileNotFoundError(f"model path {self.model!r} does not exist (nothing can be downloaded: "
                                        "give a local Hugging Face folder or a .gguf file).")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @property
    def async_scheduling_enabled(self) -> bool:
        if self.async_scheduling is None:
            return self.is_cuda
        return self.async_scheduling

    @property
    def full_decode_graphs(self) -> bool:
        return self.is_cuda and not self.enforce_eager and self.cudagraph_mode.startswith("full")

    @property
    def piecewise_graphs(self) -> bool:
        return self.is_cuda and not self.enforce_eager and self.cudagraph_mode.endswith("piecewise")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            if self.is_cuda:
                return torch.bfloat16
            # the int8 and float16 weight paths and the int8 KV cache compute in float32: asking for one asks for it
            if self.cpu_int8 or self.cpu_fp16 or self.kv_cache_dtype == "int8":  # (cpu_fp16_decode set cpu_fp16)
                return torch.float32
            if self.cpu.forced_dtype is not None:
                return self.cpu.forced_dtype
            if self.cpu.blocks:
                return torch.float32  # activations; the weights in blocks (cpu_linear)
            from nanovllm.platforms.cpu.settings import default_cpu_dtype
            return default_cpu_dtype()
        return getattr(torch, DTYPES[self.dtype])

    @property
    def cpu_linear(self) -> str:
        """How the CPU's linear layers multiply (platforms/cpu/settings.CPU_LINEAR_METHODS): int8 or fp16 where asked,
        the 4/8-bit blocks by default (dtype auto, NANOVLLM_CPU_DTYPE unset, kernels with SIMD), else the float
        weights (oneDNN-packed with NANOVLLM_CPU_PACK=1)."""
        import torch

        if self.is_cuda:
            return "float"
        if self.torch_dtype == torch.float32:
            if self.cpu_int8:
                return "int8"
            if self.cpu_fp16:
                return "fp16"
            if self.dtype == "auto" and self.cpu.forced_dtype is None and self.cpu.blocks:
                return "blocks"
        return "packed" if self.cpu.pack else "float"

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        import torch

        if self.kv_cache_dtype != "auto":
            return getattr(torch, KV_CACHE_DTYPES[self.kv_cache_dtype])
        if self.cpu_linear in ("int8", "blocks"):
            return torch.float16
        return self.torch_dtype


def model_max_len(hf_config) -> int:
    """The longest sequence the model supports (a sliding window caps it: we do not implement windows).

    YaRN stretches the positions the model was trained on by its factor: Qwen3's 32,768 x 4 = 131,072 tokens,
    the limit vLLM derives too (max_position_embeddings may hold the pretrained window or already more)."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 4096
    from nanovllm.layers.rotary import rope_parameters
    rope = rope_parameters(hf_config)
    if rope["rope_type"] == "yarn" and rope.get("factor"):
        trained = rope.get("original_max_position_embeddings") or limit
        limit = max(limit, int(trained * rope["factor"]))
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, window)
    return int(limit)
