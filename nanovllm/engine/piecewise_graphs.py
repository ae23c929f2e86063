"""Piecewise CUDA graphs for steps with a prefill in them, over a ladder of token counts.

An eager forward launches every layer's kernels from Python (hundreds of launches and torch.compile calls),
which costs the host far more than a small prefill costs the device, and every running request's next token
waits for it. A step of n tokens here replays the graphs of the next token count up: the pieces between the
layers' attention calls (attention/pieces.py), with each layer's attention run eagerly over this step's
metadata between them. Padding tokens have slot -1 (their K/V is stored nowhere) and no attention row; their
other rows are computed and dropped.
"""

from __future__ import annotations

import gc

import torch

from nanovllm.attention.metadata import AttentionMetadata, forward_context
from nanovllm.attention.pieces import PieceRecorder, recording_pieces

# The largest step captured: beyond it a step's device time dwarfs its launches anyway.
MAX_PIECEWISE_TOKENS = 8192


def token_ladder(max_tokens: int) -> list[int]:
    """Token counts with graphs: 16, 32, 48, 64, 96, 128, 192, ... (two a doubling: a step of more than 32 tokens
    pads by less than half), up to and including max_tokens."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        sizes += [size * 3 // 2] if size >= 32 and size * 3 // 2 < max_tokens else []
        size *= 2
    return sizes + [max_tokens]


class _Piecewise:
    """One token count's pieces, and the eager attention calls between them."""

    def __init__(self, graphs: list[torch.cuda.CUDAGraph], attentions: list):
        self.graphs, self.attentions = graphs, attentions


class PiecewiseGraphs:
    def __init__(self, runner, max_tokens: int):
        self.runner = runner
        model, device = runner.model, runner.device
        self.sizes = token_ladder(max_tokens)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        layer = model.attention_layers()[0]
        width = layer.num_heads * layer.head_dim
        # the attention's q and output, shared by every layer and every token count (zeros: padding rows'
        # outputs are never written, and must hold finite values)
        self.q_buffer = torch.zeros(n * width, dtype=runner.dtype, device=device)
        self.out_buffer = torch.zeros(n * width, dtype=runner.dtype, device=device)
        self.hidden = None  # [n, hidden]: every graph's last piece copies its output here
        # the rest of a capture's metadata: the replayed step's own goes to the attention calls between the pieces
        self._no_seqs = torch.zeros(1, dtype=torch.int32, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.captured: dict[int, _Piecewise] = {}
        self._capture_all(model)

    def _meta(self, num_tokens: int) -> AttentionMetadata:
        """A capture's metadata: the K/V stores read the static slots; it holds no request."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], cu_seqlens_q=self._no_seqs, seq_lens=self._no_seqs[:0],
            block_tables=self._no_seqs[:0].view(0, 0), num_decodes=0, num_decode_tokens=0, max_query_len=0,
            max_seq_len=0, query_lens_host=[], seq_lens_host=[],
        )

    def _forward(self, model, num_tokens: int, recorder: PieceRecorder) -> torch.Tensor:
        with forward_context(self._meta(num_tokens)), recording_pieces(recorder):
            return model(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def _recorder(self, num_tokens: int, capture: bool) -> PieceRecorder:
        return PieceRecorder(num_tokens, self.q_buffer, self.out_buffer, self.pool, capture)

    @torch.inference_mode()
    def _capture_all(self, model) -> None:
        # an eager warm-up at the largest size compiles every kernel first, and gives the output's shape
        self.hidden = torch.zeros_like(self._forward(model, self.sizes[-1], self._recorder(self.sizes[-1], False)))
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()  # the capture's pool takes fresh memory: hand back what eager steps cached
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            self._forward(model, size, self._recorder(size, False))  # warm-up at this size
            recorder = self._recorder(size, True)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                recorder.begin()
                self.hidden[:size] = self._forward(model, size, recorder)
                recorder.end()
            torch.cuda.current_stream().wait_stream(self.stream)
            self.captured[size] = _Piecewise(recorder.graphs, recorder.attentions)
            torch.cuda.synchronize()

    def close(self) -> None:
        """Free the graphs and their pool (before a tensor-parallel process group is destroyed: see DecodeGraphs)."""
        torch.cuda.synchronize()
        for piecewise in self.captured.values():
            for graph in piecewise.graphs:
                graph.reset()
        self.captured.clear()
        self.hidden = self.q_buffer = self.out_buffer = self.pool = None

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def replay(self, step) -> torch.Tensor:
        """Run a StepBatch of any kind through the graphs of the smallest token count that holds it; returns
        [num_tokens, hidden]."""
        n = step.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        meta = step.meta
        self.input_ids[:n].copy_(step.input_ids, non_blocking=True)
        self.positions[:n].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        piecewise = self.captured[size]
        for graph, attend in zip(piecewise.graphs[:-1], piecewise.attentions, strict=True):
            graph.replay()
            attend(meta, n)
        piecewise.graphs[-1].replay()
        return self.hidden[:n]
