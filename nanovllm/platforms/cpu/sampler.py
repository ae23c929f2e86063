"""The CPU's part of sampling, given to the runner's Sampler at load: greedy tokens through the compiled ops, and
top-k / top-p over each row's most likely tokens instead of a sort of the whole vocabulary."""

from __future__ import annotations

import torch

from nanovllm.layers.sampler import apply_top_k_top_p, sorted_probabilities, top_p_drop
from nanovllm.platforms.cpu import cpu_ops

# How many of a row's most likely tokens top_p looks at, widening on the rows it could not decide, before it
# sorts a row whole. A chat model's nucleus at top_p <= 0.95 is almost always within the first width.
CANDIDATE_WIDTHS = (256, 4096)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), ties to the lowest id; float32 rows through the compiled ops (vectorized, a thread
    per row range: torch's argmax over a 64-request step's logits takes ~4 ms on one core)."""
    if logits.dim() == 2 and logits.stride(-1) == 1 and cpu_ops.usable(logits):
        return cpu_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p's result, to the bit, decided among each row's largest logits (CANDIDATE_WIDTHS)
    wherever the kept tokens lie strictly above the smallest candidate, so that no token outside could rank
    among them. A row no width decides is sorted whole, as apply_top_k_top_p does. The checks read the tensors
    on the host, which costs nothing on the CPU."""
    num_rows, vocab = logits.shape
    uses_top_k = torch.zeros(num_rows, dtype=torch.bool) if top_k is None else top_k > 0
    # over the whole batch as apply_top_k_top_p takes it (torch may round a row of a smaller batch otherwise),
    # and only where a row without top_k needs it
    row_log_normaliser = (logits.logsumexp(dim=-1, keepdim=True) if bool((~uses_top_k & (top_p < 1)).any())
                          else logits.new_zeros(num_rows, 1))
    unfiltered = (top_p >= 1) & ~uses_top_k  # in the batch because another row filters: left as it is
    result = torch.full_like(logits, float("-inf"))
    result[unfiltered] = logits[unfiltered]
    rest = (~unfiltered).nonzero().squeeze(1)
    for width in CANDIDATE_WIDTHS:
        if rest.numel() == 0 or width >= vocab:
            break
        decided, ids, kept = _decide_among_candidates(logits[rest], None if top_k is None else top_k[rest],
                                                      row_log_normaliser[rest], top_p[rest], width)
        rows = rest[decided]
        result[rows] = result[rows].scatter_(1, ids[decided], kept[decided])
        rest = rest[~decided]
    if rest.numel():
        result[rest] = apply_top_k_top_p(logits[rest], None if top_k is None else top_k[rest], top_p[rest],
                                         row_log_normaliser[rest])
    return result


def _decide_among_candidates(logits: torch.Tensor, top_k: torch.Tensor | None, row_log_normaliser: torch.Tensor,
                             top_p: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``width`` largest logits in the full sort's order -> (decided [R] bool: the kept tokens are
    known from these alone, their ids [R, width], their logits with the dropped ones -inf [R, width])."""
    values, ids = logits.topk(width, dim=-1)  # descending; equal values in no particular order
    ids, by_id = ids.sort(dim=-1)  # equal values by ascending id, as the stable full sort ranks them
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    smallest = values[:, -1:]
    fits = torch.ones_like(top_p, dtype=torch.bool)
    if top_k is not None:  # the kth largest is a candidate's where k <= width; then every token >= it must be one
        uses_top_k = top_k > 0
        kth = values.gather(1, (top_k.clamp(1, width) - 1).unsqueeze(1))
        values = values.masked_fill((values < kth) & uses_top_k.unsqueeze(1), float("-inf"))
        fits = (top_k <= width) & (kth > smallest).squeeze(1) | ~uses_top_k
    drop = top_p_drop(sorted_probabilities(values, top_k, row_log_normaliser), top_p) | (values == float("-inf"))
    last_kept = values.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
    decided = fits & drop[:, -1] & (last_kept > smallest).squeeze(1)
    return decided, ids, values.masked_fill(drop, float("-inf"))
