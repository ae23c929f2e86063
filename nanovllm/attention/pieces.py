"""Where a piecewise CUDA graph splits: each layer's attention over the cache runs eagerly between captured pieces.

A step with a prefill in it cannot be one graph: its attention's grid and split plan depend on the step's
query and sequence lengths (host values). Everything else in the forward depends only on the number of tokens,
so it is captured in pieces for a ladder of token counts (engine/piecewise_graphs.py); while a piece is being
captured, the backend hands its attention to the recorder installed here instead of running it::

    piece 0: embedding, layer 0 up to its K/V store     -> attention 0 (eager, this step's metadata)
    piece 1: layer 0's o_proj .. layer 1's K/V store    -> attention 1 (eager)
    ...
    piece L: layer L-1's o_proj .. the final norm

Tensors that cross a split live in static buffers shared by every layer and every graph: the attention's q
(the backend writes it there) and its output. Everything else a piece allocates is freed within its forward,
so the graphs of all token counts share one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from nanovllm.attention.metadata import AttentionMetadata

# attend(q, out, meta): this step's attention of q's rows into out's rows (both views of the static buffers)
Attend = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], None]


class PieceRecorder:
    """Collects a forward's attention calls, and ends and begins the graph pieces around them while capturing.

    ``split`` returns the attention's output buffer at once: the pieces after it read it, and the replay fills
    it (``attend_all``'s caller runs each attention between the pieces' replays).
    """

    def __init__(self, num_tokens: int, q_buffer: torch.Tensor, out_buffer: torch.Tensor,
                 pool=None, capture: bool = False):
        """q_buffer, out_buffer: flat static buffers of at least num_tokens x the attention's q width.
        capture: end and begin CUDA graphs at each split (False: a warm-up forward, attention skipped)."""
        self.num_tokens = num_tokens
        self.q_buffer, self.out_buffer = q_buffer, out_buffer
        self.pool = pool
        self.capture = capture
        self.attentions: list[Callable[[AttentionMetadata, int], None]] = []
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def q_destination(self, num_heads: int, head_dim: int) -> torch.Tensor:
        """Where the backend's fused kernel writes q: [num_tokens, num_heads, head_dim] in the static buffer."""
        return self._view(self.q_buffer, num_heads, head_dim)

    def split(self, q: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The attention of q ([num_tokens, heads, head_dim]) as a split point; returns its output buffer."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        static_q = self._view(self.q_buffer, num_heads, head_dim)
        if q.data_ptr() != static_q.data_ptr():  # q was made by torch ops, not written in place by the kernel
            static_q.copy_(q)
        out = self._view(self.out_buffer, num_heads, head_dim)
        self.attentions.append(lambda meta, n: attend(static_q[:n], out[:n], meta))
        if self.capture:
            self.graphs[-1].capture_end()
            self.begin()
        return out

    def begin(self) -> None:
        """Start capturing the next piece (on the caller's capture stream)."""
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def _view(self, buffer: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
        width = num_heads * head_dim
        assert buffer.numel() >= self.num_tokens * width, \
            f"static buffer of {buffer.numel()} values < {self.num_tokens} tokens x {width}"
        return buffer[:self.num_tokens * width].view(self.num_tokens, num_heads, head_dim)


_recorder: PieceRecorder | None = None


@contextmanager
def recording_pieces(recorder: PieceRecorder) -> Iterator[PieceRecorder]:
    """Attention layers running inside hand their attention to ``recorder``. Never nested."""
    global _recorder
    assert _recorder is None, "piece recorders do not nest"
    _recorder = recorder
    try:
        yield recorder
    finally:
        _recorder = None


def piece_recorder() -> PieceRecorder | None:
    """The recorder of the forward being captured (or warmed up) in pieces, else None."""
    return _recorder
