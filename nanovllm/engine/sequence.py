"""Sequence: one request's generation state and its view of the paged KV cache."""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass
from enum import Enum, auto
from itertools import count
from typing import TYPE_CHECKING, Any

from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.engine.spec_decode.proposer import SpecState
    from nanovllm.structured_outputs import RequestGrammar


class SequenceStatus(Enum):
    # Waiting for compute or memory; this includes a request whose prefill is not fully scheduled yet.
    WAITING = auto()
    # The whole prompt has been scheduled, so the request goes on to decode. The scheduler sets this when it
    # schedules the last prefill chunk, before that step's forward has actually run.
    RUNNING = auto()
    # Reached EOS / a stop condition / its length limit (or was aborted); never scheduled again.
    FINISHED = auto()


@dataclass(slots=True)
class SequenceExtras:
    """What the engine keeps per sample of a request beyond the Sequence's scheduling and KV state: who it belongs
    to, why it finished, and the sampler's per-request state. The engine creates it (``LLMEngine.add_request``);
    it stays in the engine's process (a tensor-parallel worker's Sequence has none)."""

    request_id: str | None = None
    index: int = 0  # which of the request's n samples this is
    finish_reason: str | None = None  # why it finished: "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    min_tokens_stop_ids: tuple[int, ...] = ()  # EOS + stop_token_ids, masked until min_tokens
    needs_prompt_logprobs: bool = False  # the runner computes logits on its prompt rows while set
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # bad_words as token ids (engine/sampling.py)
    grammar: RequestGrammar | None = None  # a structured-outputs request's matcher (nanovllm/structured_outputs)
    # Made on first use: a seeded request's generator (torch, or numpy's for per-step seeds); (numpy buffer,
    # filled) of token_ids for penalties; its sampling settings once they are static (all engine/sampling.py);
    # its proposal history (engine/spec_decode).
    generator: Any = None
    token_array_cache: tuple | None = None
    sampling_row: tuple | None = None
    spec_state: SpecState | None = None


class Sequence:
    # The default KV block size only: each Sequence carries its own (its engine's kvcache_block_size), since
    # engines with different block sizes can share a process. No engine writes this class attribute.
    block_size = 256
    # Class-wide id generator. Warm-up also builds sequences, so the first user request need not get id 0.
    counter = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams = SamplingParams(),
                 block_size: int | None = None, extras: SequenceExtras | None = None):
        self.seq_id = next(Sequence.counter)
        # an instance attribute, read by the block arithmetic below in place of the class default
        self.block_size = Sequence.block_size if block_size is None else block_size
        self.status = SequenceStatus.WAITING
        # A copy: append_token() must not change the caller's list.
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)
        # Compute progress: tokens whose K/V is in the cache (prefix-cache hits add to it directly).
        self.num_cached_tokens = 0
        # Tokens scheduled into this step's forward; 0 before scheduling and again after postprocessing.
        self.num_scheduled_tokens = 0
        # True while the prompt is processed; the scheduler clears it on entering decode, preemption sets it again.
        self.is_prefill = True
        # Physical KV block ids in the logical order of the tokens.
        self.block_table: list[int] = []
        self.temperature = sampling_params.temperature
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        # Beyond the contract, scheduling and KV state: the full parameters (the scheduler's stop checks and the
        # sampler read them every step), the prefix-cache hashes of the full blocks computed so far, and the
        # draft tokens this step verifies after last_token (speculative decoding: the scheduler sets them, they
        # are not in token_ids until accepted, and a worker gets them with the step).
        self.sampling_params = sampling_params
        self.block_hashes: list[int] = []
        self.draft_token_ids: list[int] = []
        # Everything else the engine keeps per request: one object, never pickled to workers.
        self.extras = SequenceExtras() if extras is None else extras

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        # Ceiling division: with block size 256, 256 tokens need 1 block and 257 need 2.
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """The token ids of logical block i (token content, not KV tensors)."""
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        # The new token's K/V is not computed yet; the next decode step computes it.
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1

    def truncate(self, num_tokens: int) -> None:
        """Drop the tokens after the first ``num_tokens`` (a finished request whose last step produced several
        tokens, when a stop string ended it before the last of them)."""
        assert self.num_prompt_tokens < num_tokens <= self.num_tokens
        del self.token_ids[num_tokens:]
        self.num_tokens = num_tokens
        self.last_token = self.token_ids[-1]

    def __getstate__(self):
        # What a tensor-parallel worker needs for one step: prefill needs the token list, decode only the last token
        # (and the step's draft tokens).
        last_state = self.last_token if not self.is_prefill else self.token_ids
        return (self.num_tokens, self.num_prompt_tokens, self.num_cached_tokens, self.num_scheduled_tokens,
                self.block_table, self.draft_token_ids, last_state, self.block_size)

    def __setstate__(self, state):
        (self.num_tokens, self.num_prompt_tokens, self.num_cached_tokens, self.num_scheduled_tokens,
         self.block_table, self.draft_token_ids, last_state, self.block_size) = state
        if isinstance(last_state, list):
            self.token_ids = last_state
            self.last_token = self.token_ids[-1]
            self.is_prefill = True
        else:
            # A decode worker holds no token history: code on workers must not read token_ids in decode.
            self.token_ids = []
            self.last_token = last_state
            self.is_prefill = False
