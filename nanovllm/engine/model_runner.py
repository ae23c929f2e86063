"""ModelRunner: owns the model, the KV pool and the sampler; runs one scheduled step on its device."""

from __future__ import annotations

import logging

import torch

from nanovllm.attention.metadata import forward_context
from nanovllm.config import EngineConfig
from nanovllm.engine.batch import StepBatch, prepare_batch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Sampler
from nanovllm.loader.weights import checkpoint_tensors, load_weights
from nanovllm.models import model_class

logger = logging.getLogger(__name__)


def make_attention_backend(config: EngineConfig):
    name = config.attention_backend or ("triton" if config.is_cuda else "torch")
    if name == "triton":
        from nanovllm.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    from nanovllm.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_path: str, max_model_len: int,
                 rank: int = 0, device: torch.device | None = None):
        self.config = config
        self.rank = rank
        self.max_model_len = max_model_len
        self.block_size = config.kvcache_block_size
        self.device = device or torch.device(config.device)
        self.dtype = config.torch_dtype
        torch.manual_seed(config.seed)

        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(hf_config)(hf_config, max_model_len)
        finally:
            torch.set_default_dtype(previous_dtype)
        self.model.eval()
        load_weights(self.model, checkpoint_tensors(self.model, model_path, config, self.device),
                     source=model_path if config.load_format != "dummy" else "dummy weights")

        self.backend = make_attention_backend(config)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.num_kvcache_blocks = self._decide_num_blocks()
        self._allocate_kv_cache(self.num_kvcache_blocks)
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            from nanovllm.engine.cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(self)

    # -- KV pool -------------------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        layer = self.model.attention_layers()[0]
        per_token = 2 * len(self.model.attention_layers()) * layer.num_kv_heads * layer.head_dim
        return per_token * self.block_size * self.dtype.itemsize

    def _decide_num_blocks(self) -> int:
        config = self.config
        if config.num_kvcache_blocks is not None:
            return config.num_kvcache_blocks
        if config.kv_cache_memory_bytes is not None or self.device.type != "cuda":
            from nanovllm.config import DEFAULT_CPU_KV_CACHE_BYTES
            budget = config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = budget // self.kv_bytes_per_block
        else:
            num_blocks = self._profile_free_blocks()
        if num_blocks < 1:
            raise ValueError(f"the KV cache has room for no block of {self.block_size} tokens "
                             f"({self.kv_bytes_per_block} bytes each); give it more memory.")
        return int(num_blocks)

    def _profile_free_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization after a forward at the largest batch."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocate_kv_cache(1)
        num_tokens = self.config.max_num_batched_tokens
        seq_len = min(self.max_model_len, num_tokens)
        seqs = []
        while num_tokens > 0:
            seq = Sequence([0] * min(seq_len, num_tokens))
            seq.num_scheduled_tokens = seq.num_tokens
            seq.block_table = [0] * seq.num_blocks
            seqs.append(seq)
            num_tokens -= seq.num_tokens
            if len(seqs) >= self.config.max_num_seqs:
                break
        batch = prepare_batch(seqs, self.block_size, self.device)
        batch.meta.slot_mapping.fill_(-1)  # write nothing: the one-block cache is only there to be read
        self._forward(batch)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        usable = total * self.config.gpu_memory_utilization - (total - free) - (peak - current)
        self.kv_cache = None
        return int(usable // self.kv_bytes_per_block)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        layers = self.model.attention_layers()
        head = layers[0]
        # [k/v, layer, block, offset, kv_head, head_dim]
        self.kv_cache = torch.zeros(2, len(layers), num_blocks, self.block_size, head.num_kv_heads, head.head_dim,
                                    dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.bind(self.kv_cache[0, i], self.kv_cache[1, i], self.backend)

    # -- one step ------------------------------------------------------------------------------------------------
    def _forward(self, batch: StepBatch) -> torch.Tensor:
        with forward_context(batch.meta):
            return self.model(batch.input_ids, batch.positions)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int | None]:
        """Compute the scheduled tokens; the next token of each sequence that reached its end (else None)."""
        batch = prepare_batch(seqs, self.block_size, self.device)
        if self.graphs is not None and batch.is_decode_only and self.graphs.fits(len(seqs)):
            hidden = self.graphs.replay(batch)
        else:
            hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden[batch.sample_indices])
        tokens: list[int | None] = [None] * len(seqs)
        if logits is None or not batch.sampled_seq_indices:
            return tokens
        temperatures = torch.tensor([seqs[i].temperature for i in batch.sampled_seq_indices],
                                    dtype=torch.float32).to(self.device, non_blocking=True)
        sampled = self.sampler(logits.float(), temperatures, self.generator).tolist()
        for i, token in zip(batch.sampled_seq_indices, sampled):
            tokens[i] = token
        return tokens
