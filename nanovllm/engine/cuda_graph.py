"""CUDA graphs of the decode step over a ladder of batch sizes; a batch replays the next size up.

A decode step launches hundreds of small kernels; replaying a captured graph removes their launch cost.
Each graph reads its inputs from static buffers (filled before replay) and writes static outputs. Padding
rows have seq_len 0 and slot -1: they write no KV and read none.
"""

from __future__ import annotations

import torch

from nanovllm.attention.metadata import AttentionMetadata, forward_context


def batch_size_ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, runner, max_batch: int = 512):
        self.runner = runner
        model, device = runner.model, runner.device
        self.max_batch = min(runner.config.max_num_seqs, max_batch)
        self.sizes = batch_size_ladder(self.max_batch)
        max_blocks = (runner.max_model_len + runner.block_size - 1) // runner.block_size
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.outputs = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._capture_all(model)

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], cu_seqlens_q=self.cu_seqlens_q[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            num_decodes=batch, num_decode_tokens=batch, max_query_len=1,
            max_seq_len=self.runner.max_model_len,  # the split plan must cover any length a replay may see
            query_lens_host=[1] * batch, seq_lens_host=[self.runner.max_model_len] * batch,
        )

    def _run(self, model, batch: int) -> torch.Tensor:
        with forward_context(self._meta(batch)):
            return model(self.input_ids[:batch], self.positions[:batch])

    @torch.inference_mode()
    def _capture_all(self, model) -> None:
        self.outputs = self._run(model, self.max_batch)  # eager warm-up: compiles every kernel first
        torch.cuda.synchronize()
        for batch in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            self._run(model, batch)  # warm-up at this size
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[:batch] = self._run(model, batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
            torch.cuda.synchronize()

    def close(self) -> None:
        """Free the graphs and their memory pool. With tensor parallelism the graphs hold NCCL work: they must
        go before the process group is destroyed, or destroying it can wait forever."""
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = self.outputs = None

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch

    def replay(self, step) -> torch.Tensor:
        """Run a decode-only StepBatch through the smallest graph that holds it; returns [batch, hidden]."""
        batch = step.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= batch)
        meta = step.meta
        self.input_ids[:batch].copy_(step.input_ids, non_blocking=True)
        self.positions[:batch].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[batch:size].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[batch:size].zero_()
        width = meta.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[:batch]
