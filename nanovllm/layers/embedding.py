"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.state import current_tensor_parallel
from nanovllm.layers.linear_method import UNQUANTIZED


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = current_tensor_parallel()  # its engine's: another engine may share this process
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + self.tp_size - 1) // self.tp_size
        if self.tp_size > 1:  # slices start on multiples of 4, as the sampling kernel's noise needs
            self.shard_size = (self.shard_size + 3) // 4 * 4
        # this rank's columns that are real tokens (the last slice may be partly padding)
        self.num_valid = max(0, min(self.shard_size, vocab_size - self.shard_size * self.tp_rank))
        self.vocab_start = self.shard_size * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit an embedding of "
                             f"{self.vocab_size} x {param.shape[1]}")
        part = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the whole vocabulary, gathered on rank 0 (other ranks return None); or, for a step that needs
    only temperatures, the sampled tokens on every rank with no logits gathered (``sample_on_slices``). Its product
    goes through ``linear_method`` (layers/linear_method.py), as a linear layer's."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.linear_method = UNQUANTIZED

    def sample_on_slices(self, hidden: torch.Tensor, temperatures: torch.Tensor,
                         seeds: torch.Tensor) -> torch.Tensor:
        """[rows] int64 token ids, equal on every rank: each rank draws from its slice of the vocabulary (the
        same noise per token as one device), and only each slice's (score, id) winner crosses ranks."""
        from nanovllm.kernels.sampling import gumbel_argmax_with_scores, merge_shard_winners
        logits = self.linear_method.apply(self, hidden, None)[:, :self.num_valid]
        ids, scores = gumbel_argmax_with_scores(logits, temperatures, seeds, id_offset=self.vocab_start)
        mine = torch.stack([scores.view(torch.int32), ids.to(torch.int32)])  # one [2, rows] message per rank
        everyone = mine.new_empty(self.tp_size * 2, mine.shape[1])
        dist.all_gather_into_tensor(everyone, mine)
        everyone = everyone.view(self.tp_size, 2, -1)
        return merge_shard_winners(everyone[:, 0].view(torch.float32), everyone[:, 1])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.linear_method.apply(self, hidden, None)  # F.linear unless the platform chose another
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        if self.tp_rank != 0:
            return None
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]
