"""Host side of sampling: one step's SamplingTensors from its sequences, and the step's results as Python lists.

Everything here runs once per step over the sequences that get a token (a short loop over requests, never over
the vocabulary); the tensors go to the device in a few copies, and the results come back in one transfer.
"""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass, field

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SampledLogprobs, SamplingTensors, compute_logprobs
from nanovllm.sampling_params import SAMPLING_EPS

# Prompt rows whose logits are computed at once for prompt_logprobs: bounds the [rows, vocab] logits in memory.
PROMPT_LOGPROBS_CHUNK = 512

# 64-bit seeds: seed + sample index wraps instead of overflowing torch's manual_seed.
_SEED_MASK = (1 << 64) - 1


@dataclass
class TokenLogprobs:
    """Log-probabilities of one generated (or prompt) token under the model's raw distribution."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int]  # the most likely tokens, best first
    top_logprobs: list[float]


@dataclass
class PromptLogprobs:
    """Logprobs of a run of prompt tokens: entry j is for prompt token ``first_position + j`` (>= 1)."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass
class RunnerOutput:
    """What one step of the runner produced, per sequence of the batch (rank 0; other ranks return no tokens)."""

    token_ids: list[int | None]  # None: the step computed only a chunk of the prompt, nothing was sampled
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per sequence; None if not asked for
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # batch index -> computed run


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # Small arrays: a plain asynchronous copy (pinning a fresh buffer every step costs more than it saves).
    return torch.from_numpy(array).to(device, non_blocking=True)


def token_array(seq: Sequence) -> np.ndarray:
    """seq's token ids as int64, cached on the sequence and extended by the new tokens only (they only grow)."""
    extras = seq.extras
    buffer, filled = extras.token_array_cache or (np.empty(0, dtype=np.int64), 0)
    if filled < seq.num_tokens:
        if len(buffer) < seq.num_tokens:
            grown = np.empty(max(seq.num_tokens, 2 * len(buffer)), dtype=np.int64)
            grown[:filled] = buffer[:filled]
            buffer = grown
        buffer[filled:seq.num_tokens] = seq.token_ids[filled:seq.num_tokens]
        extras.token_array_cache = (buffer, seq.num_tokens)
    return buffer[:seq.num_tokens]


def _token_counts(arrays: list[np.ndarray], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32 occurrence counts of each row's tokens."""
    width = max(1, max(len(a) for a in arrays))
    ids = np.full((len(arrays), width), vocab_size, dtype=np.int64)  # padding lands in an extra column
    for row, a in enumerate(arrays):
        ids[row, :len(a)] = a
    ids_t = _to_device(ids, device)
    counts = torch.zeros(len(arrays), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids_t, torch.ones(ids_t.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def request_generator(seq: Sequence, device: torch.device) -> torch.Generator | None:
    """The seeded request's own generator (sample i of n uses seed + i), created on first use."""
    seed = seq.sampling_params.seed
    if seed is None:
        return None
    extras = seq.extras
    if extras.generator is None:
        extras.generator = torch.Generator(device=device).manual_seed((seed + extras.index) & _SEED_MASK)
    return extras.generator


_GREEDY_ROW = (0.0, 1.0, 0, 0.0)


def _is_greedy(p) -> bool:
    # top_k=1 keeps only the most likely token: exactly greedy (also when logits tie, as they do in bf16).
    return p.temperature < SAMPLING_EPS or p.top_k == 1


def _bans_stop_tokens(seq: Sequence, num_drafted: int = 0) -> bool:
    """min_tokens not yet reached: EOS and the stop ids may not be sampled this step (at a row after
    ``num_drafted`` draft tokens, which then count as generated)."""
    p = seq.sampling_params
    return bool(p.min_tokens) and seq.num_completion_tokens + num_drafted < p.min_tokens


def row_seed_source(seq: Sequence) -> np.random.Generator:
    """The seeded request's own host generator of per-step seeds (sample i of n uses seed + i)."""
    extras = seq.extras
    if extras.generator is None:
        extras.generator = np.random.default_rng((seq.sampling_params.seed + extras.index) & _SEED_MASK)
    return extras.generator


def build_sampling_tensors(seqs: list[Sequence], vocab_size: int, device: torch.device,
                           seed_source: np.random.Generator | None = None,
                           drafted: list[list[int]] | None = None) -> SamplingTensors:
    """Per-row settings of the sequences that get a token this step (row i = seqs[i]); one pass over them.

    drafted: speculative decoding's verify rows: a sequence may fill several rows, row i sampling after the
    draft tokens ``drafted[i]``, which its penalties and min_tokens count as generated ones.

    seed_source: draw each sampled row's noise inside the sampling kernel from a per-step seed (CUDA): unseeded
    rows take their seeds from it, seeded requests from their own host generator. None: noise from torch
    generators (``generators`` and the sampler's).
    """
    rows: list[tuple] = []  # temperature (0 = greedy), top_p, top_k, min_p
    generators: dict[int, torch.Generator] = {}
    banned: list[tuple[int, int]] = []
    penalised: list[int] = []
    with_logprobs: list[int] = []
    biased: list[tuple[int, int, float]] = []
    masked: list[int] = []
    any_top_p = any_min_p = False
    max_top_k = num_sampled = 0
    for i, seq in enumerate(seqs):
        p = seq.sampling_params
        if _is_greedy(p):
            rows.append(_GREEDY_ROW)  # a greedy row's filters do not matter: its token is the argmax
        else:
            rows.append((p.temperature, p.top_p, p.top_k, p.min_p))
            num_sampled += 1
            any_top_p = any_top_p or p.top_p < 1.0
            any_min_p = any_min_p or p.min_p > 0.0
            max_top_k = max(max_top_k, p.top_k)
            if p.seed is not None:
                generators[i] = row_seed_source(seq) if seed_source is not None else request_generator(seq, device)
        if _bans_stop_tokens(seq, len(drafted[i]) if drafted else 0):
            banned.extend((i, t) for t in seq.extras.min_tokens_stop_ids)
        if p.masks_logits:
            if p.logit_bias:
                biased.extend((i, t, b) for t, b in p.logit_bias.items())
            extras = seq.extras
            if extras.bad_words_token_ids:
                banned.extend((i, t) for t in bad_word_tokens(seq))
            if extras.grammar is not None or p.allowed_token_ids is not None:
                masked.append(i)
        if p.has_penalties:
            penalised.append(i)
        if p.logprobs is not None:
            with_logprobs.append(i)

    all_greedy = num_sampled == 0
    if all_greedy:
        tensors = SamplingTensors(temperatures=torch.zeros(len(seqs), device=device), all_greedy=True)
    else:
        # one host->device copy for the four per-row values
        values = _to_device(np.array(rows, dtype=np.float32).T.copy(), device)
        if seed_source is None:
            tensors = SamplingTensors(temperatures=values[0], generators=generators)
        else:
            seeds = _draw_row_seeds(len(seqs), seed_source, generators)
            tensors = SamplingTensors(temperatures=values[0], row_seeds=_to_device(seeds, device))
        if any_top_p:
            tensors.top_p = values[1]
        if max_top_k > 0:
            tensors.top_k, tensors.max_top_k = values[2].long(), max_top_k
        if any_min_p:
            tensors.min_p = values[3]

    if banned:
        pairs = _to_device(np.array(banned, dtype=np.int64).T.copy(), device)
        tensors.banned_rows, tensors.banned_tokens = pairs[0], pairs[1]
    if biased:
        pairs = _to_device(np.array([(i, t) for i, t, _ in biased], dtype=np.int64).T.copy(), device)
        tensors.bias_rows, tensors.bias_tokens = pairs[0], pairs[1]
        tensors.bias_values = _to_device(np.array([b for _, _, b in biased], dtype=np.float32), device)
    if masked:
        tensors.mask_rows = _to_device(np.array(masked, dtype=np.int64), device)
        tensors.token_bitmask = _to_device(token_bitmask([seqs[i] for i in masked], vocab_size).numpy(), device)

    if penalised:
        params = [seqs[i].sampling_params for i in penalised]
        penalties = _to_device(np.array([(p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
                                         for p in params], dtype=np.float32).T.copy(), device)
        tensors.penalty_rows = _to_device(np.array(penalised, dtype=np.int64), device)
        tensors.presence_penalties, tensors.frequency_penalties, tensors.repetition_penalties = penalties
        arrays = [token_array(seqs[i]) for i in penalised]
        outputs = [a[seqs[i].num_prompt_tokens:] for i, a in zip(penalised, arrays, strict=True)]
        if drafted:
            outputs = [np.concatenate([a, np.asarray(drafted[i], dtype=np.int64)])
                       for i, a in zip(penalised, outputs, strict=True)]
        tensors.output_counts = _token_counts(outputs, vocab_size, device)
        if any(p.repetition_penalty != 1.0 for p in params):
            prompts = [a[:seqs[i].num_prompt_tokens] for i, a in zip(penalised, arrays, strict=True)]
            tensors.prompt_mask = _token_counts(prompts, vocab_size, device) > 0

    if with_logprobs:
        tensors.logprob_rows = _to_device(np.array(with_logprobs, dtype=np.int64), device)
        tensors.num_logprobs = max(seqs[i].sampling_params.logprobs for i in with_logprobs)
    return tensors


def _static_row(seq: Sequence) -> tuple | None:
    """The sequence's sampling settings when they no longer change from step to step, else None: (temperature (0 =
    greedy), top_p, top_k, min_p, seeded, logprobs width or -1). Rows that mask logits, use penalties or still ban
    stop tokens (min_tokens) are built anew each step. Cached on the sequence: its parameters never change, and a
    min_tokens ban, once over, does not return (the generated tokens only grow)."""
    extras = seq.extras
    row = extras.sampling_row
    if row is None:
        p = seq.sampling_params
        if p.masks_logits or p.has_penalties or _bans_stop_tokens(seq):
            return None
        logprobs = -1 if p.logprobs is None else p.logprobs
        if _is_greedy(p):
            row = (*_GREEDY_ROW, False, logprobs)  # a greedy row's filters do not matter, nor its seed
        else:
            row = (p.temperature, p.top_p, p.top_k, p.min_p, p.seed is not None, logprobs)
        extras.sampling_row = row
    return row


@dataclass
class _CachedSampling:
    """The parts of a step's SamplingTensors that stay while the rows' sequences do (everything but the seeds)."""

    seq_ids: list[int]
    tensors: SamplingTensors  # with row_seeds unset: a fresh draw each step
    seeded: dict[int, np.random.Generator]  # row -> the seeded request's host generator (CUDA's in-kernel seeds)


class SamplingTensorCache:
    """One runner's SamplingTensors across steps: rebuilt only when the rows' sequences (or their order) change.

    A decode step's sampling settings are the same as the step before's as long as the same sequences sample in
    the same order and none of them reads its history (penalties, bad words, grammars, a min_tokens ban): then
    only the per-step noise seeds are drawn anew (in the order ``build_sampling_tensors`` draws them). A batch
    with such rows, or with draft rows, is built in full each step.
    """

    def __init__(self):
        self._cached: _CachedSampling | None = None

    def build(self, seqs: list[Sequence], vocab_size: int, device: torch.device,
              seed_source: np.random.Generator | None = None,
              drafted: list[list[int]] | None = None) -> SamplingTensors:
        if drafted is not None:
            return build_sampling_tensors(seqs, vocab_size, device, seed_source, drafted)
        seq_ids = [s.seq_id for s in seqs]
        cached = self._cached
        if cached is None or cached.seq_ids != seq_ids:
            rows = [_static_row(s) for s in seqs]
            tensors = build_sampling_tensors(seqs, vocab_size, device, seed_source)
            if None in rows:
                self._cached = None
                return tensors
            # kept without this step's seeds; a seeded row (never a greedy one) draws from its request's generator
            seeded = {} if seed_source is None else {i: row_seed_source(seqs[i]) for i, row in enumerate(rows)
                                                       if row[4]}
            kept = copy(tensors)
            kept.row_seeds = None
            self._cached = _CachedSampling(seq_ids, kept, seeded)
            return tensors
        tensors = copy(cached.tensors)
        if seed_source is not None and not tensors.all_greedy:
            tensors.row_seeds = _to_device(_draw_row_seeds(len(seqs), seed_source, cached.seeded), device)
        return tensors


def token_bitmask(seqs: list[Sequence], vocab_size: int) -> torch.Tensor:
    """[len(seqs), ceil(V / 32)] int32 CPU bitmask of the tokens each sequence may sample next: its grammar's
    (nanovllm/structured_outputs), and-ed with its allowed_token_ids."""
    width = (vocab_size + 31) // 32
    bitmask = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for row, seq in enumerate(seqs):
        grammar = seq.extras.grammar
        if grammar is not None:
            grammar.fill_bitmask(bitmask, row)
        allowed = seq.sampling_params.allowed_token_ids
        if allowed is not None:
            bits = np.zeros(width * 32, dtype=bool)
            bits[[t for t in allowed if t < vocab_size]] = True
            words = np.packbits(bits.reshape(width, 32), axis=1, bitorder="little").view("<i4").reshape(width)
            bitmask[row] &= torch.from_numpy(words.copy())
    return bitmask


def bad_word_tokens(seq: Sequence) -> list[int]:
    """The tokens that would complete one of seq's bad words now: a word's last token, when the output ends with
    the word's other tokens (a one-token word is always banned)."""
    output = seq.token_ids[seq.num_prompt_tokens:]
    banned = []
    for word in seq.extras.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and tuple(output[len(output) - len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned


def _draw_row_seeds(num_rows: int, seed_source: np.random.Generator,
                    seeded: dict[int, np.random.Generator]) -> np.ndarray:
    """This step's noise seed of each row: from the engine's source, or the seeded request's own."""
    seeds = seed_source.integers(0, 1 << 62, size=num_rows, dtype=np.int64)
    for i, source in seeded.items():
        seeds[i] = source.integers(0, 1 << 62)
    return seeds


def temperature_only_rows(seqs: list[Sequence],
                          seed_source: np.random.Generator) -> tuple[np.ndarray, np.ndarray] | None:
    """Each row's temperature (0 = greedy) and noise seed, when that is all the step's sampling needs; else None.

    Such a step can be sampled by tensor-parallel ranks each on its own slice of the vocabulary (top-k, top-p,
    min-p, penalties, min_tokens and logprobs need the whole row). Draws the same seeds, in the same order, as
    ``build_sampling_tensors`` would for these rows, so the tokens do not depend on which path sampled them.
    """
    temperatures = np.zeros(len(seqs), dtype=np.float32)
    seeded: dict[int, np.random.Generator] = {}
    for i, seq in enumerate(seqs):
        row = _static_row(seq)  # None: it reads its history (penalties, masks, a min_tokens ban)
        if row is None or row[5] >= 0:  # (or wants logprobs)
            return None
        temperature, top_p, top_k, min_p, is_seeded, _ = row
        if temperature == 0:  # greedy
            continue
        if top_p < 1.0 or top_k > 0 or min_p > 0.0:
            return None
        temperatures[i] = temperature
        if is_seeded:
            seeded[i] = row_seed_source(seq)
    if not temperatures.any():  # all greedy: build_sampling_tensors draws no seeds either
        return temperatures, np.zeros(len(seqs), dtype=np.int64)
    return temperatures, _draw_row_seeds(len(seqs), seed_source, seeded)


def logprob_entries(result: SampledLogprobs, token_ids: list[int], widths: list[int]) -> list[TokenLogprobs]:
    """The device-side logprobs of L rows as Python objects; row j keeps its own top-``widths[j]``."""
    logprobs, ranks = result.sampled.tolist(), result.ranks.tolist()
    top_ids, top_logprobs = result.top_ids.tolist(), result.top_logprobs.tolist()
    return [TokenLogprobs(token_ids[j], logprobs[j], ranks[j], top_ids[j][:widths[j]], top_logprobs[j][:widths[j]])
            for j in range(len(token_ids))]


# -- prompt logprobs --------------------------------------------------------------------------------------------
def wants_prompt_logprobs(seq: Sequence) -> bool:
    # A tensor-parallel worker's Sequence has only the pickled step state (no extras), hence getattr.
    extras = getattr(seq, "extras", None)
    return extras is not None and extras.needs_prompt_logprobs


def prompt_logprob_rows(seqs: list[Sequence], indices: list[int]) -> list[tuple[int, int, int]]:
    """(batch index, first hidden row, number of rows) of the prompt positions whose next token is a prompt token.

    Position p's logits predict token p + 1, so a chunk [start, end) of the prompt contributes positions
    [start, min(end, num_prompt_tokens - 1)): the last prompt position predicts the first generated token.
    Uses only what a tensor-parallel worker also has (the pickled step state).
    """
    offsets = np.cumsum([0] + [s.num_scheduled_tokens for s in seqs])
    plan = []
    for i in indices:
        seq = seqs[i]
        start = seq.num_cached_tokens
        end = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
        if end > start:
            plan.append((i, int(offsets[i]), end - start))
    return plan


def compute_prompt_logprobs(compute_logits, hidden: torch.Tensor, seqs: list[Sequence],
                            plan: list[tuple[int, int, int]]) -> dict[int, PromptLogprobs]:
    """Logprobs of the prompt tokens in ``plan``, computing logits PROMPT_LOGPROBS_CHUNK rows at a time.

    compute_logits may return None (a tensor-parallel worker): it is still called for every chunk, since the LM
    head gathers across ranks, and nothing is returned.
    """
    device = hidden.device
    rows = np.concatenate([np.arange(first, first + count) for _, first, count in plan])
    rows_t = _to_device(rows.astype(np.int64), device)
    parts = []
    for start in range(0, len(rows), PROMPT_LOGPROBS_CHUNK):
        logits = compute_logits(hidden[rows_t[start:start + PROMPT_LOGPROBS_CHUNK]])
        if logits is None:
            continue
        if not parts:  # rank 0: the prompt tokens scored and how many alternatives each request wants
            targets = [t for i, _, count in plan
                       for t in seqs[i].token_ids[seqs[i].num_cached_tokens + 1:seqs[i].num_cached_tokens + 1 + count]]
            targets_t = _to_device(np.array(targets, dtype=np.int64), device)
            widths = [seqs[i].sampling_params.prompt_logprobs for i, _, count in plan for _ in range(count)]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        parts.append(compute_logprobs(logprobs, targets_t[start:start + PROMPT_LOGPROBS_CHUNK], max(widths)))
    if not parts:
        return {}
    merged = SampledLogprobs(*(torch.cat([getattr(p, name) for p in parts])
                               for name in ("sampled", "ranks", "top_ids", "top_logprobs")))
    entries = logprob_entries(merged, targets, widths)
    result, at = {}, 0
    for i, _, count in plan:
        result[i] = PromptLogprobs(seqs[i].num_cached_tokens + 1, entries[at:at + count])
        at += count
    return result
