"""Token sampling for a whole batch in one vectorised pass on the device, without a host sync.

Per row of logits, in this order (vLLM's):

    raw logits --> logprobs (log_softmax of the raw logits, for rows that report them)
        |
        logit_bias -> token bitmask (structured outputs, allowed_token_ids) -> min_tokens / bad words mask (EOS / stop ids -> -inf) -> penalties -> argmax = the greedy token
        |
        / temperature -> min_p -> top_k -> top_p -> the sampled token

The sampled token is drawn in one of two ways, both without a host sync. With per-row noise seeds (CUDA), a
Triton kernel takes argmax(logits / T + Gumbel noise) in one pass over the logits, no softmax. Otherwise (the CPU)
the token is where a row's cumulative probability first exceeds one uniform draw: one random number a row, where
noise costs one per vocabulary entry, which on the CPU took several times the sum and the search (measured in
docs/benchmarks.md). A seeded row draws from its own generator, so its tokens
depend on its seed alone, not on the batch around it. Each stage runs only when some row in the batch uses it (the flags
and sizes in SamplingTensors are plain Python values, known without looking at the device), and then as one
batched operation over the rows: a row that does not use a stage passes through it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class SamplingTensors:
    """One step's per-row sampling settings, on the device. B = rows (sequences that get a token), V = vocab.

    Optional parts are None when no row needs them, so the sampler skips their stage.
    """

    temperatures: torch.Tensor  # [B] float32; 0 = greedy
    all_greedy: bool = False
    top_k: torch.Tensor | None = None  # [B] int64; 0 = off
    max_top_k: int = 0  # the largest top_k in the batch, for a cheap topk() when no row uses top_p
    top_p: torch.Tensor | None = None  # [B] float32; 1 = off
    min_p: torch.Tensor | None = None  # [B] float32; 0 = off
    # logit_bias: (row, token id, bias) triples added to the logits
    bias_rows: torch.Tensor | None = None  # [num_biased] int64
    bias_tokens: torch.Tensor | None = None  # [num_biased] int64
    bias_values: torch.Tensor | None = None  # [num_biased] float32
    # structured outputs / allowed_token_ids: for M rows, bit j of word w allows token 32 * w + j
    mask_rows: torch.Tensor | None = None  # [M] int64
    token_bitmask: torch.Tensor | None = None  # [M, ceil(V / 32)] int32
    # min_tokens, bad words: (row, token id) pairs forced to -inf
    banned_rows: torch.Tensor | None = None  # [num_banned] int64
    banned_tokens: torch.Tensor | None = None  # [num_banned] int64
    # penalties, for the rows that use any (R of them)
    penalty_rows: torch.Tensor | None = None  # [R] int64
    presence_penalties: torch.Tensor | None = None  # [R] float32
    frequency_penalties: torch.Tensor | None = None  # [R] float32
    repetition_penalties: torch.Tensor | None = None  # [R] float32
    output_counts: torch.Tensor | None = None  # [R, V] float32: occurrences of each token in the output so far
    prompt_mask: torch.Tensor | None = None  # [R, V] bool: token occurs in the prompt
    # row -> its own generator (seeded requests)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # [B] int64: each row's seed for this step, when the noise is drawn inside the sampling kernel (CUDA); then
    # ``generators`` is unused: a seeded request's seeds come from its own host generator
    row_seeds: torch.Tensor | None = None
    # logprobs, for the rows that report them (L of them)
    logprob_rows: torch.Tensor | None = None  # [L] int64
    num_logprobs: int = 0  # top-k width (the largest request in the batch)


@dataclass
class SampledLogprobs:
    """Log-probabilities (of the raw logits) for the rows in SamplingTensors.logprob_rows."""

    sampled: torch.Tensor  # [L] float32: the sampled token's
    ranks: torch.Tensor  # [L] int64: 1 + how many tokens are strictly more likely than the sampled one
    top_ids: torch.Tensor  # [L, num_logprobs] int64, most likely first
    top_logprobs: torch.Tensor  # [L, num_logprobs] float32


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: SampledLogprobs | None = None


# -- stages (each a pure function of tensors, also used by tests as references to compare against) ----------------
def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor | None,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """OpenAI presence/frequency penalties over the output, then vLLM's repetition penalty over prompt + output.

    logits, output_counts: [R, V]; prompt_mask: [R, V] bool (None: no prompt tokens count); penalties: [R].
    """
    seen = output_counts > 0
    if prompt_mask is not None:
        seen = seen | prompt_mask
    rep = repetition.unsqueeze(1)
    # A positive logit shrinks and a negative one grows in magnitude: both make the token less likely for rep > 1.
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, repeated, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of logits [B, V] keep only the tokens whose bit is set in bitmask [M, ceil(V / 32)] int32;
    the others become -inf. Unpacked on the logits' device (32x fewer bytes to copy than a boolean mask)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [M, V]
    masked = logits[rows].masked_fill(allowed.logical_not(), float("-inf"))
    return logits.index_copy(0, rows, masked)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability < min_p * (the top probability): in log space, logit < max + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)  # log(0) = -inf: no filter
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k largest logits (0 = all); one topk() of the batch's largest k, no full sort."""
    vocab = logits.shape[-1]
    max_top_k = min(max_top_k, vocab)
    top = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    k = top_k.clamp(1, max_top_k)
    kth = top.gather(1, (k - 1).unsqueeze(1))
    kth = torch.where((top_k > 0).unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor,
                      row_log_normaliser: torch.Tensor | None = None) -> torch.Tensor:
    """top_k (0 = off) then top_p (1 = off) over one sort of each row, most likely first.

    top_p keeps the smallest set of most likely tokens whose probability (after top_k) sums to >= top_p: a token
    stays while the tokens ranked above it hold less than top_p, so the most likely token always stays. The sort
    is stable: among equal logits the lowest token id ranks first, as in argmax, so a tiny top_p is exactly greedy.
    row_log_normaliser: logits.logsumexp(dim=-1, keepdim=True), where the caller has it already.
    """
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        kth = ordered.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
        ordered = ordered.masked_fill((ordered < kth) & (top_k > 0).unsqueeze(1), float("-inf"))
    if row_log_normaliser is None:
        row_log_normaliser = logits.logsumexp(dim=-1, keepdim=True)
    drop = top_p_drop(sorted_probabilities(ordered, top_k, row_log_normaliser), top_p)
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def top_p_drop(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, N] probabilities sorted most likely first -> [B, N] bool: the tokens top_p drops, those with at least
    top_p of the mass ranked above them."""
    mass_above = probs.cumsum(dim=-1) - probs
    return (mass_above >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)  # rounding must not touch top_p=1 rows


def sorted_probabilities(ordered: torch.Tensor, top_k: torch.Tensor | None,
                         row_log_normaliser: torch.Tensor) -> torch.Tensor:
    """The softmax of rows sorted most likely first, top_k's dropped tokens already -inf: [B, N] -> [B, N].

    A row under top_k is normalised over its own kept values by a running sum, which the CPU adds in order, so
    any prefix holding all its kept tokens gives the same bits (platforms/cpu/sampler.py searches such a prefix);
    a row without top_k by row_log_normaliser [B, 1], the logsumexp of its whole row."""
    if top_k is None:
        return (ordered - row_log_normaliser).exp()
    top = ordered[:, :1]
    kept_sum = (ordered - top).exp().cumsum(dim=-1)[:, -1:]
    log_normaliser = torch.where((top_k > 0).unsqueeze(1), top + kept_sum.log(), row_log_normaliser)
    return (ordered - log_normaliser).exp()


def compute_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> SampledLogprobs:
    """logprobs: [L, V] (log-softmaxed); token_ids: [L] -> each token's logprob and rank, and the top num_top."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [L, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = token_ids.new_empty(logprobs.shape[0], 0)
    return SampledLogprobs(chosen.squeeze(1), ranks, top_ids, top_logprobs)


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None,
                       generators: dict[int, torch.Generator]) -> torch.Tensor:
    """A token of each row of probs [B, V] (rows need not sum to 1): the first whose cumulative probability
    exceeds a uniform draw scaled to the row's total. A row with its own generator draws from it alone."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    uniform = torch.rand(total.shape, dtype=total.dtype, device=total.device, generator=generator)
    for row, row_generator in generators.items():  # the seeded rows only: a loop over requests, not the vocab
        uniform[row] = torch.rand(1, dtype=total.dtype, device=total.device, generator=row_generator)
    # strictly below the total: the token found then has a cumulative sum above the one before it, so p > 0
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(1)


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of logits [B, V] -> [B] int64 (ties to the lowest id)."""
    return logits.argmax(dim=-1)


class Sampler(nn.Module):
    def __init__(self, greedy_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 top_k_top_p: Callable[..., torch.Tensor] | None = None) -> None:
        """greedy_tokens, top_k_top_p: the platform's argmax_tokens and apply_top_k_top_p, where it has faster
        ones with the same results (platforms/cpu/sampler.py)."""
        super().__init__()
        self.greedy_tokens = greedy_tokens or argmax_tokens
        self.top_k_top_p = top_k_top_p or apply_top_k_top_p

    def forward(self, logits: torch.Tensor, params: SamplingTensors | torch.Tensor,
                generator: torch.Generator | None = None) -> SamplerOutput:
        """logits: [B, V] -> SamplerOutput (token ids [B], and logprobs for the rows that report them).

        params may also be a plain [B] tensor of temperatures (0 = greedy), for temperature-only sampling.
        The input logits are never modified in place.
        """
        if isinstance(params, torch.Tensor):
            params = SamplingTensors(temperatures=params)
        sampled_logprobs = None
        raw_logprobs = None
        if params.logprob_rows is not None:
            raw_logprobs = torch.log_softmax(logits[params.logprob_rows].float(), dim=-1)

        # float32 only where logits are changed; the kernel path reads the model's dtype as it is
        if (params.banned_rows is not None or params.penalty_rows is not None or params.row_seeds is None
                or params.bias_rows is not None or params.mask_rows is not None):
            logits = logits.float()
        if params.bias_rows is not None:
            logits = logits.index_put((params.bias_rows, params.bias_tokens), params.bias_values, accumulate=True)
        if params.mask_rows is not None:
            logits = apply_token_bitmask(logits, params.mask_rows, params.token_bitmask)
        if params.banned_rows is not None:
            logits = logits.index_put((params.banned_rows, params.banned_tokens), logits.new_full((), float("-inf")))
        if params.penalty_rows is not None:
            rows = params.penalty_rows
            penalised = apply_penalties(logits[rows], params.output_counts, params.prompt_mask,
                                        params.presence_penalties, params.frequency_penalties,
                                        params.repetition_penalties)
            logits = logits.index_copy(0, rows, penalised)

        filtered = params.min_p is not None or params.top_p is not None or params.top_k is not None
        if params.all_greedy:
            token_ids = self.greedy_tokens(logits)
        elif params.row_seeds is not None and not filtered:
            token_ids = gumbel_argmax(logits, params.temperatures, params.row_seeds)  # one pass, no softmax
        else:
            temperatures = params.temperatures
            is_greedy = temperatures == 0
            scaled = logits.float() / torch.where(is_greedy, torch.ones_like(temperatures), temperatures).unsqueeze(1)
            if params.min_p is not None:
                scaled = apply_min_p(scaled, params.min_p)
            if params.top_p is not None:
                scaled = self.top_k_top_p(scaled, params.top_k, params.top_p)
            elif params.top_k is not None:
                scaled = apply_top_k(scaled, params.top_k, params.max_top_k)
            if params.row_seeds is not None:
                # already divided by the temperature: the kernel only adds the row's noise (0 keeps greedy rows)
                token_ids = gumbel_argmax(scaled, is_greedy.logical_not().float(), params.row_seeds)
            else:
                sampled = inverse_cdf_sample(torch.softmax(scaled, dim=-1), generator, params.generators)
                token_ids = torch.where(is_greedy, self.greedy_tokens(logits), sampled)

        if raw_logprobs is not None:
            sampled_logprobs = compute_logprobs(raw_logprobs, token_ids[params.logprob_rows], params.num_logprobs)
        return SamplerOutput(token_ids, sampled_logprobs)


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, row_seeds: torch.Tensor) -> torch.Tensor:
    from nanovllm.kernels.sampling import gumbel_argmax as kernel  # triton only when this path runs
    return kernel(logits, temperatures, row_seeds)
