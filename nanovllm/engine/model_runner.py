"""ModelRunner: owns the model, the KV pool and the sampler; runs one scheduled step on its device."""

from __future__ import annotations

import logging
import math
import mmap

import numpy as np
import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import forward_context
from nanovllm.config import EngineConfig
from nanovllm.distributed.state import TensorParallel, building_model
from nanovllm.engine.batch import DecodeBlockTables, StepBatch, prepare_batch, prepare_decode_ahead
from nanovllm.engine.sampling import (
    RunnerOutput,
    SamplingTensorCache,
    _to_device,
    compute_prompt_logprobs,
    logprob_entries,
    prompt_logprob_rows,
    wants_prompt_logprobs,
)
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.spec_decode.acceptance import accepted_tokens
from nanovllm.layers.compile import building_compiled
from nanovllm.layers.quantization.fp8 import (
    add_block_scales,
    checkpoint_block_size,
    expand_block_scales,
    quantize_linear_layers,
    use_block_scales,
)
from nanovllm.layers.sampler import SampledLogprobs, Sampler, SamplerOutput, SamplingTensors
from nanovllm.loader.weights import checkpoint_tensors, load_weights
from nanovllm.models import model_class
from nanovllm.models.decoder import quantize_norm_outputs
from nanovllm.platforms.cpu import cpu_ops
from nanovllm.platforms.cpu import sampler as cpu_sampler
from nanovllm.platforms.cpu.model import prepare_model

logger = logging.getLogger(__name__)


def make_attention_backend(config: EngineConfig) -> AttentionBackend:
    """triton: the Triton kernels (the CUDA default); torch: on the CPU its own backend (the default there), on
    CUDA the reference functions."""
    name = config.attention_backend or ("triton" if config.is_cuda else "torch")
    if name == "triton":
        from nanovllm.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if not config.is_cuda:
        from nanovllm.platforms.cpu.attention import CpuAttentionBackend
        return CpuAttentionBackend()
    from nanovllm.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()


def zeroed_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in anonymous mapped memory: the OS backs a page with RAM when it is first written, so
    the process holds the KV blocks used so far, not the whole pool from the start (torch.zeros writes it all)."""
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(count * dtype.itemsize, 1))  # anonymous: zero-filled by the OS
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # the tensor keeps the mapping alive


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_path: str, max_model_len: int,
                 tp: TensorParallel | None = None, device: torch.device | None = None):
        """tp: this rank's place in its engine's tensor-parallel group (None: one rank, no collectives)."""
        self.config = config
        self.tp = tp if tp is not None else TensorParallel()
        self.rank = self.tp.rank
        self.max_model_len = max_model_len
        self.block_size = config.kvcache_block_size
        self.device = device or torch.device(config.device)
        self.dtype = config.torch_dtype
        torch.manual_seed(config.seed)

        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), building_model(self.tp), building_compiled(config.compile_small_ops):
                self.model = model_class(hf_config)(hf_config, max_model_len)
                # an HF fp8 checkpoint: its e4m3 weights and block scales (layers/quantization/fp8.py)
                fp8_blocks = checkpoint_block_size(hf_config) if config.load_format != "gguf" else None
                if fp8_blocks is not None:
                    add_block_scales(self.model, fp8_blocks)
        finally:
            torch.set_default_dtype(previous_dtype)
        self.model.eval()
        self.custom_all_reduce = None
        if self.device.type == "cuda" and self.tp.size > 1 and not config.disable_custom_all_reduce:
            from nanovllm.distributed.symmetric_all_reduce import SymmetricAllReduce
            self.custom_all_reduce = self.tp.custom_all_reduce = SymmetricAllReduce.create(self.device)
        tensors = checkpoint_tensors(self.model, model_path, config, self.device)
        if fp8_blocks is not None:
            tensors = expand_block_scales(tensors, self.model.checkpoint_shapes(), fp8_blocks)
        load_weights(self.model, tensors, source=model_path if config.load_format != "dummy" else "dummy weights")
        if fp8_blocks is not None:
            use_block_scales(self.model, fp8_blocks)
        elif config.quantization == "fp8":  # a float checkpoint quantized here
            quantize_linear_layers(self.model)
            quantize_norm_outputs(self.model)
        if self.device.type == "cpu":
            # the CPU's own norm/activation/rotary layers and each linear layer's method, chosen once (platforms/cpu/)
            prepare_model(self.model, config.cpu_linear, config.cpu.int8_tiles, config.cpu.block_passes)

        self.backend = make_attention_backend(config)
        on_cpu = self.device.type == "cpu"
        self.sampler = Sampler(cpu_sampler.greedy_tokens if on_cpu else None, cpu_sampler.top_k_top_p if on_cpu else None)
        self.decode_tables = DecodeBlockTables()  # block tables kept across planned decode steps
        self.sampling_cache = SamplingTensorCache()  # kept across steps while the same sequences sample
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        # CUDA: sampling noise is drawn inside the sampling kernel from per-step seeds (nanovllm/kernels/sampling.py)
        self.seed_source = np.random.default_rng(config.seed) if self.device.type == "cuda" else None
        self.num_kvcache_blocks = self._agree_across_ranks(self._decide_num_blocks())
        self._allocate_kv_cache(self.num_kvcache_blocks)
        self.graphs = self.piecewise = None
        if config.full_decode_graphs:
            from nanovllm.engine.cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(self)
        if config.piecewise_graphs and self.backend.name == "triton":  # the torch reference loops on the host
            from nanovllm.engine.piecewise_graphs import MAX_PIECEWISE_TOKENS, PiecewiseGraphs
            self.piecewise = PiecewiseGraphs(self, min(config.max_num_batched_tokens, MAX_PIECEWISE_TOKENS))

    def close(self) -> None:
        """Release the CUDA graphs (before a tensor-parallel process group is destroyed) and the KV pool (its
        memory goes back to the device at once, the weights when the engine is dropped)."""
        for graphs in (self.graphs, self.piecewise):
            if graphs is not None:
                graphs.close()
        self.graphs = self.piecewise = None
        if self.custom_all_reduce is not None:
            self.tp.custom_all_reduce = None
            self.custom_all_reduce.close()
            self.custom_all_reduce = None
        for layer in self.model.attention_layers():  # their views would keep the whole pool alive
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # so that an engine made next in this process can size its pool from it

    # -- KV pool -------------------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        layers, dtype = self.model.attention_layers(), self.config.kv_torch_dtype
        row = cpu_ops.kv_cache_row_width(dtype, layers[0].head_dim)
        return 2 * len(layers) * layers[0].num_kv_heads * row * self.block_size * dtype.itemsize

    def _decide_num_blocks(self) -> int:
        config = self.config
        if config.num_kvcache_blocks is not None:
            return config.num_kvcache_blocks
        if config.kv_cache_memory_bytes is not None:
            num_blocks = config.kv_cache_memory_bytes // self.kv_bytes_per_block
        elif self.device.type != "cuda":
            # what the limits let requests hold at once (max_num_seqs of max_model_len tokens each), within the
            # default budget of tokens (at least one full-length request) and of bytes
            from nanovllm.config import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_CPU_KV_CACHE_TOKENS
            blocks_per_seq = -(-self.max_model_len // self.block_size)
            token_budget = -(-max(self.max_model_len, DEFAULT_CPU_KV_CACHE_TOKENS) // self.block_size)
            num_blocks = min(config.max_num_seqs * blocks_per_seq, token_budget,
                             DEFAULT_CPU_KV_CACHE_BYTES // self.kv_bytes_per_block)
        else:
            num_blocks = self._profile_free_blocks()
        if num_blocks < 1:
            raise ValueError(f"the KV cache has room for no block of {self.block_size} tokens "
                             f"({self.kv_bytes_per_block} bytes each); give it more memory.")
        return int(num_blocks)

    def _agree_across_ranks(self, num_blocks: int) -> int:
        """Every tensor-parallel rank must use the same pool size: the smallest any rank can hold."""
        return self.tp.min(num_blocks, self.device)

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
            seq = Sequence([0] * min(seq_len, num_tokens), block_size=self.block_size)
            seq.num_scheduled_tokens = seq.num_tokens
            seq.block_table = [0] * seq.num_blocks
            seqs.append(seq)
            num_tokens -= seq.num_tokens
            if len(seqs) >= self.config.max_num_seqs:
                break
        batch = prepare_batch(seqs, self.block_size, self.device)
        batch.meta.slot_mapping.fill_(-1)  # write nothing: the one-block cache is only there to be read
        hidden = self._forward(batch)
        self._profile_sampler(hidden)
        del hidden
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        usable = total * self.config.gpu_memory_utilization - (total - free) - (peak - current)
        self.kv_cache = None
        return int(usable // self.kv_bytes_per_block)

    def _profile_sampler(self, hidden: torch.Tensor) -> None:
        """Sample max_num_seqs rows the costliest way (top-p sorts the vocabulary, logprobs add a log-softmax):
        its [rows, vocab] float32 temporaries can outweigh the forward's, and the KV pool must leave room."""
        rows = min(self.config.max_num_seqs, hidden.shape[0])
        logits = self.model.compute_logits(hidden[:rows])
        if logits is None:
            return
        ones = torch.ones(rows, device=self.device)
        params = SamplingTensors(temperatures=ones, top_p=ones * 0.9, top_k=ones.long() * 50, max_top_k=50,
                                 logprob_rows=torch.arange(rows, device=self.device), num_logprobs=20)
        self.sampler(logits, params, self.generator)

    def _allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype | None = None) -> None:
        layers = self.model.attention_layers()
        head, dtype = layers[0], dtype or self.config.kv_torch_dtype
        if dtype == torch.int8 and cpu_ops.load() is None:
            raise ValueError("kv_cache_dtype 'int8' is read by the compiled CPU ops only, and they did not build (no "
                             "C compiler, or NANOVLLM_CPU_KERNELS=0): use 'auto' or 'float16'.")
        # [k/v, layer, block, offset, kv_head, head_dim (int8: + its scale's 4 bytes)]
        shape = (2, len(layers), num_blocks, self.block_size, head.num_kv_heads,
                 cpu_ops.kv_cache_row_width(dtype, head.head_dim))
        if self.device.type == "cpu":
            self.kv_cache = zeroed_on_first_touch(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.bind(self.kv_cache[0, i], self.kv_cache[1, i], self.backend)

    # -- one step ------------------------------------------------------------------------------------------------
    def _forward(self, batch: StepBatch) -> torch.Tensor:
        self.backend.prepare(batch.meta, self.block_size)
        with forward_context(batch.meta):
            return self.model(batch.input_ids, batch.positions)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], prompt_logprob_seqs: list[int] | None = None) -> RunnerOutput:
        """Compute the scheduled tokens, and sample the next token of each sequence that reached its end.

        prompt_logprob_seqs: batch indices of sequences whose scheduled prompt rows also need logits (for
        prompt_logprobs). None derives them from the sequences (``needs_prompt_logprobs``), which only rank 0's
        Sequences carry: a tensor-parallel driver must compute the list on rank 0 and give every rank the same.
        """
        return self.launch(seqs, prompt_logprob_seqs).result()

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], prompt_logprob_seqs: list[int] | None = None,
               after: StepHandle | None = None, source_rows: list[int] | None = None,
               slice_sampling: tuple[np.ndarray, np.ndarray] | None = None) -> StepHandle:
        """Start the step on the device and return at once (on CUDA); ``result()`` waits for its tokens.

        after: the step still running before this one, whose sampled tokens are this step's inputs: every
        sequence here decodes the token it has in flight there (see ``prepare_decode_ahead``).
        source_rows: each sequence's row in ``after``'s sampled tokens; by default looked up from the sequences
        themselves (a tensor-parallel worker's are fresh copies each step, so rank 0 sends the rows).
        slice_sampling: (temperatures, seeds) of the sampled rows, from rank 0's ``temperature_only_rows``: every
        rank samples on its slice of the vocabulary (tensor parallel; the step needs nothing else).
        """
        if after is None:
            self.decode_tables.reset()  # this step may preempt, allocate or trim: tables change in any way
            batch = prepare_batch(seqs, self.block_size, self.device)
        else:
            if source_rows is None:
                source_rows = after.rows_of(seqs)
            batch = prepare_decode_ahead(seqs, source_rows, self.block_size, self.device, self.decode_tables)
            batch.input_ids = after.token_ids.index_select(0, batch.input_ids)
            prompt_logprob_seqs = []  # decodes only; the sequences' step fields still describe the step before
        if self.graphs is not None and batch.is_decode_only and self.graphs.fits(batch.meta.num_seqs):
            hidden = self.graphs.replay(batch)
        elif self.piecewise is not None and self.piecewise.fits(batch.input_ids.shape[0]):
            hidden = self.piecewise.replay(batch)
        else:
            hidden = self._forward(batch)
        if slice_sampling is not None:
            return self._sample_on_slices(seqs, batch, hidden, slice_sampling)
        return self._sample(seqs, batch, hidden, prompt_logprob_seqs)

    def _sample_on_slices(self, seqs: list[Sequence], batch: StepBatch, hidden: torch.Tensor,
                          slice_sampling: tuple[np.ndarray, np.ndarray]) -> StepHandle:
        """Every rank samples on its slice of the vocabulary: no logits gathered, and every rank has the tokens
        (so no broadcast of them either)."""
        handle = StepHandle(seqs, batch)
        if not batch.sampled_seq_indices:
            return handle
        temperatures, seeds = (_to_device(a, self.device) for a in slice_sampling)
        token_ids = self.model.lm_head.sample_on_slices(hidden[batch.sample_indices], temperatures, seeds)
        handle.token_ids = token_ids
        if self.rank == 0:
            handle.fetch(SamplerOutput(token_ids))
        return handle

    def _sample(self, seqs: list[Sequence], batch: StepBatch, hidden: torch.Tensor,
                prompt_logprob_seqs: list[int] | None) -> StepHandle:
        handle = StepHandle(seqs, batch)
        logits = self.model.compute_logits(hidden[batch.sample_indices])  # every rank: the LM head gathers
        if prompt_logprob_seqs is None:
            prompt_logprob_seqs = [i for i, s in enumerate(seqs) if wants_prompt_logprobs(s)]
        plan = prompt_logprob_rows(seqs, prompt_logprob_seqs) if prompt_logprob_seqs else []
        if plan:
            handle.prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden, seqs, plan)
        if not batch.sampled_seq_indices:
            return handle
        if logits is not None:
            sampled = batch.sampled_seq_indices
            if logits.shape[0] == len(sampled):  # a row each
                row_seqs, drafted = (seqs if len(sampled) == len(seqs) else [seqs[i] for i in sampled]), None
            else:  # a verifying request has a row per token: row j samples after its first j draft tokens
                row_seqs, drafted = [], []
                for i, count in zip(sampled, batch.sample_counts, strict=True):
                    row_seqs += [seqs[i]] * count
                    drafted += [seqs[i].draft_token_ids[:j] for j in range(count)]
            params = self.sampling_cache.build(row_seqs, logits.shape[-1], self.device, self.seed_source, drafted)
            result = self.sampler(logits, params, self.generator)
            handle.token_ids = result.token_ids
            handle.fetch(result)
        if self.shares_sampled_tokens:
            handle.token_ids = self._share_sampled_tokens(handle.token_ids, len(batch.sampled_seq_indices))
        return handle

    @property
    def shares_sampled_tokens(self) -> bool:
        """Tensor parallel with planned steps: every rank needs the sampled ids on its device, as inputs of the
        step planned after this one (only rank 0 samples)."""
        return self.tp.size > 1 and self.config.async_scheduling_enabled

    def _share_sampled_tokens(self, token_ids: torch.Tensor | None, count: int) -> torch.Tensor:
        """Rank 0's sampled ids, on every rank's device: a broadcast queued on the stream, no host sync."""
        import torch.distributed as dist
        token_ids = torch.empty(count, dtype=torch.int64, device=self.device) if token_ids is None \
            else token_ids.contiguous()
        dist.broadcast(token_ids, src=0)
        return token_ids


class StepHandle:
    """A step started on the device: its sampled tokens (device tensor), copied to the host without blocking.

    ``result()`` waits for that copy only, not for work queued after the step, so the host can plan and launch
    the next step before this one's tokens are known (asynchronous scheduling).
    """

    def __init__(self, seqs: list[Sequence], batch: StepBatch):
        self.seqs = seqs
        self.batch = batch
        self.token_ids: torch.Tensor | None = None  # [num_sampled] on the device, batch.sampled_seq_indices order
        self.prompt_logprobs = {}
        self._host: list[torch.Tensor] = []  # token ids, then the logprobs tensors
        self._logprobs = None
        self._done: torch.cuda.Event | None = None

    def rows_of(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's row in ``token_ids`` (every one of them sampled in this step)."""
        if seqs == self.seqs and len(self.batch.sampled_seq_indices) == len(seqs):  # the same batch again
            return list(range(len(seqs)))
        row_of_seq = {id(self.seqs[i]): row for row, i in enumerate(self.batch.sampled_seq_indices)}
        return [row_of_seq[id(s)] for s in seqs]

    def fetch(self, result) -> None:
        tensors = [result.token_ids]
        if result.logprobs is not None:
            self._logprobs = result.logprobs
            tensors += [result.logprobs.sampled, result.logprobs.ranks, result.logprobs.top_ids,
                        result.logprobs.top_logprobs]
        if result.token_ids.device.type != "cuda":
            self._host = tensors
            return
        for tensor in tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._host.append(host)
        self._done = torch.cuda.Event()
        self._done.record()

    def result(self) -> RunnerOutput:
        seqs, batch = self.seqs, self.batch
        output = RunnerOutput(token_ids=[None] * len(seqs), logprobs=[None] * len(seqs),
                              prompt_logprobs=self.prompt_logprobs)
        if not self._host:
            return output
        if self._done is not None:
            self._done.synchronize()
        token_ids = self._host[0].tolist()
        if len(token_ids) == len(batch.sampled_seq_indices) == len(seqs):  # every sequence sampled one row
            output.token_ids = token_ids
            row_counts = None
        elif len(token_ids) == len(batch.sampled_seq_indices):  # one row each: no request verified a draft
            for i, token in zip(batch.sampled_seq_indices, token_ids, strict=True):
                output.token_ids[i] = token
            row_counts = None
        else:
            row_counts = batch.sample_counts
            first = 0
            for i, count in zip(batch.sampled_seq_indices, row_counts, strict=True):
                draft = seqs[i].draft_token_ids
                rows = token_ids[first:first + count]
                output.token_ids[i] = accepted_tokens(draft, rows) if draft else rows[0]
                first += count
        if self._logprobs is not None:
            self._add_logprobs(output, token_ids, row_counts)
        return output

    def _add_logprobs(self, output: RunnerOutput, token_ids: list[int], row_counts: list[int] | None) -> None:
        """Logprobs of the sampled tokens, for the requests that want them; a verifying request's for each token
        it keeps (a list)."""
        seqs, batch = self.seqs, self.batch
        counts = row_counts or [1] * len(batch.sampled_seq_indices)
        row_seq, row_firsts, first = [], [], 0  # per sample row: its sequence, and that sequence's first row
        for i, count in zip(batch.sampled_seq_indices, counts, strict=True):
            row_seq += [i] * count
            row_firsts += [first] * count
            first += count
        rows = [r for r, i in enumerate(row_seq) if seqs[i].sampling_params.logprobs is not None]
        entries = logprob_entries(SampledLogprobs(*self._host[1:]), [token_ids[r] for r in rows],
                                  [seqs[row_seq[r]].sampling_params.logprobs for r in rows])
        for r, entry in zip(rows, entries, strict=True):
            i = row_seq[r]
            if row_counts is None or not seqs[i].draft_token_ids:
                output.logprobs[i] = entry
                continue
            kept = output.token_ids[i]
            if r - row_firsts[r] < len(kept):
                if output.logprobs[i] is None:
                    output.logprobs[i] = []
                output.logprobs[i].append(entry)
