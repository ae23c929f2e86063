"""Continuous batching: each step, pick which requests run and how many tokens each computes.

There is no separate prefill phase: a request has ``num_cached_tokens`` computed out of ``num_tokens``, and a
step closes part of that gap within a token budget (``max_num_batched_tokens``). Running requests decode one
token each; the budget left over goes to waiting requests in arrival order, the last one admitted taking a
chunk of its prompt if the whole prompt does not fit. The full blocks a prefill will fill are published to the
prefix cache as soon as it is scheduled, so requests admitted after it in the same step share them (64 requests
with one system prompt compute it once). When the KV pool runs dry, the newest running request
is preempted: it gives its blocks back and returns to the front of the queue, to be recomputed later.

With speculative decoding a running request may verify draft tokens too: it computes 1 + len(draft) tokens,
taking budget and free blocks only from what the other running requests' plain decodes leave (drafts never
preempt anyone), and after the step it keeps the accepted ones; the slots of rejected ones are given back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.spec_decode.config import SpeculativeConfig
from nanovllm.engine.spec_decode.metrics import SpecDecodeStats
from nanovllm.engine.spec_decode.proposer import NgramProposer


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_kvcache_blocks: int
    kvcache_block_size: int
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "xxh64"
    speculative: SpeculativeConfig | None = None


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0
    num_decode_tokens_computed: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: set[int]):
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, config.prefix_caching_hash_algo)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.stats = SchedulerStats()
        self.spec_stats = SpecDecodeStats()
        self.proposer = NgramProposer(config.speculative) if config.speculative is not None else None
        # blocks published when the step in flight was scheduled, before their K/V exists (see undo_step)
        self._published: list[tuple[int, int]] = []

    # -- queue ------------------------------------------------------------------------------------------------
    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue seq last, or with ``first`` ahead of every other waiting request except one whose prefill is
        under way (it holds blocks and must stay at the head)."""
        if not first:
            self.waiting.append(seq)
        elif self.waiting and self.waiting[0].block_table:
            self.waiting.insert(1, seq)
        else:
            self.waiting.appendleft(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def abort(self, seq: Sequence) -> bool:
        """Drop an unfinished request and free its blocks; False if it was not queued here."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
                self._finish(seq, "abort")
                return True
        return False

    # -- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> list[Sequence]:
        """The step's batch, decodes first; each sequence's num_scheduled_tokens is set."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[Sequence] = []
        preempted = False

        # 1. Running requests decode one token each, oldest first; make room by preempting the newest.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            while not self.block_manager.can_append(seq):
                # The newest holder of blocks goes first: a half-prefilled request at the head of the queue
                # (admitted after every running one), else the last running request.
                partial = self.waiting and self.waiting[0].block_table
                victim = self.waiting.popleft() if partial else self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                self._propose(seq, budget - 1, others=len(self.running) - i - 1)
                seq.num_scheduled_tokens = 1 + len(seq.draft_token_ids)
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
                i += 1
                continue
            break  # seq preempted itself: everything after it is gone too

        # 2. Waiting requests, in arrival order, while budget, sequence slots and blocks last.
        if not preempted:
            holding = len(self.running) + sum(1 for s in self.waiting if s.block_table)
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if not seq.block_table:
                    with self._prefix_cache_reads(seq):
                        if holding >= self.config.max_num_seqs or not self.block_manager.can_allocate(seq):
                            break
                        self.block_manager.allocate(seq)
                    holding += 1
                num_new = min(seq.num_tokens - seq.num_cached_tokens, budget)
                assert num_new > 0
                seq.num_scheduled_tokens = num_new
                # the blocks this chunk fills are shared from now on, with requests admitted later in this step
                self._published += self.block_manager.cache_blocks(seq, seq.num_cached_tokens + num_new)
                budget -= num_new
                scheduled.append(seq)
                if seq.num_cached_tokens + num_new < seq.num_tokens:
                    break  # a chunk: this request continues next step, still at the head of the queue
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
        return scheduled

    def _propose(self, seq: Sequence, budget: int, others: int) -> None:
        """Set seq's draft tokens for this step (none without speculation, or when none fits or pays).

        budget: tokens left after seq's own; others: running requests after seq in this step, each of which may
        still need a token of budget and a free block.
        """
        seq.draft_token_ids = []
        # a grammar's mask of a draft row would need the grammar advanced through the drafts before it
        if self.proposer is None or seq.extras.grammar is not None:
            return
        limit = min(budget - others, self.config.max_model_len - seq.num_tokens - 1)
        if seq.max_tokens is not None:
            limit = min(limit, seq.max_tokens - seq.num_completion_tokens - 1)  # the model's own token counts too
        drafts = self.proposer.propose(seq, limit)
        if not drafts:
            return
        spare_blocks = max(self.block_manager.num_free_blocks - others, 0)
        room = (len(seq.block_table) + spare_blocks) * self.config.kvcache_block_size - seq.num_tokens
        seq.draft_token_ids = drafts[:room]
        self.block_manager.reserve_slots(seq, seq.num_tokens + len(seq.draft_token_ids))

    def schedule_ahead(self, in_flight: list[Sequence]) -> list[Sequence]:
        """The next step planned while ``in_flight`` (the step just launched) still runs; [] if it cannot be.

        Each running sequence then has one token in flight, whose id only the device knows yet; the next step
        decodes it. That plan holds only when the next step is exactly "every running request decodes": nothing
        waits, every running request samples a token in the step in flight, no request's sampling reads its own
        history (penalties, a min_tokens mask, bad words, a structured-outputs grammar: a grammar's mask needs
        the token in flight), and free blocks cover every new block needed (no preemption).
        A request that will reach its length limit with the token in flight is left out; one that stops on EOS
        or a stop string is only known later: its token of the planned step is dropped (``postprocess``).
        """
        if self.waiting or not self.running or len(self.running) > self.config.max_num_batched_tokens:
            return []
        if self.proposer is not None and (any(s.draft_token_ids for s in in_flight)
                                          or any(self.proposer.may_propose(s) for s in self.running)):
            return []  # a draft's accepted length, or the next one, needs the tokens in flight
        sampled = {id(s) for s in in_flight if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens}
        block_size, max_model_len = self.config.kvcache_block_size, self.config.max_model_len
        seqs, growing = [], []
        for seq in self.running:
            if id(seq) not in sampled:
                return []
            # (settings the sampler found static neither read the history nor wait for min_tokens: engine/sampling.py)
            params = seq.sampling_params
            if seq.extras.sampling_row is None and (params.min_tokens > seq.num_tokens - seq.num_prompt_tokens
                                             or params.reads_output):
                return []
            after = seq.num_tokens + 1  # once the token in flight is appended
            if ((seq.max_tokens is not None and after - seq.num_prompt_tokens >= seq.max_tokens)
                    or after >= max_model_len):
                continue  # finishes with the token in flight: nothing more to compute
            if len(seq.block_table) * block_size < after:
                growing.append(seq)
            seqs.append(seq)
        if len(growing) > self.block_manager.num_free_blocks:
            return []
        for seq in growing:  # the others' slot for the token in flight is in a block they hold
            self.block_manager.reserve_slots(seq, seq.num_tokens + 1)
        if self.proposer is not None:
            for seq in seqs:
                self.proposer.pass_step(seq)
        return seqs

    @contextmanager
    def _prefix_cache_reads(self, seq: Sequence) -> Iterator[None]:
        """A request that wants prompt_logprobs computes its whole prompt: a cache hit would skip the rows its
        logprobs come from (vLLM skips reading the cache for it too). Its blocks are still published."""
        saved = self.block_manager.enable_prefix_caching
        if seq.extras.needs_prompt_logprobs:
            self.block_manager.enable_prefix_caching = False
        try:
            yield
        finally:
            self.block_manager.enable_prefix_caching = saved

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.stats.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """seq (in no queue now) gives its blocks back and waits at the front, to be computed from the start."""
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        seq.num_scheduled_tokens = 0
        seq.draft_token_ids = []
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def _dequeue(self, seq: Sequence) -> None:
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
                return

    def undo_step(self, seqs: list[Sequence]) -> None:
        """The step scheduled as ``seqs`` failed: its K/V may be missing. Blocks published for it are taken
        back, and its prefills, which may have hit them, go back to the front of the queue to start afresh;
        decodes simply repeat."""
        self.block_manager.unpublish(self._published)
        self._published = []
        for seq in reversed(seqs):
            if seq.draft_token_ids and not seq.is_finished:
                seq.draft_token_ids = []
                self.block_manager.trim(seq)
            if seq.is_finished or not seq.is_prefill:
                continue
            self._dequeue(seq)
            self._requeue(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | list[int] | None]) -> list[Sequence]:
        """Record the step: advance progress, append sampled tokens, finish requests. Returns the finished.

        token_ids[i] is None for a sequence that only computed a chunk of its prompt (nothing sampled), and a
        list for one that verified draft tokens: its accepted drafts and then the model's next token. Tokens are
        appended one by one, each checked for a stop; a list is cut in place to the tokens kept.
        """
        self._published = []  # their K/V is written now
        finished = []
        eos_token_ids, max_model_len = self.eos_token_ids, self.config.max_model_len
        block_size, caching = self.config.kvcache_block_size, self.block_manager.enable_prefix_caching
        num_decoded, running = 0, SequenceStatus.RUNNING
        for seq, token_id in zip(seqs, token_ids, strict=True):
            if (type(token_id) is int and not seq.is_prefill and not seq.draft_token_ids
                    and seq.status is running):
                # a plain decode, the common case: what the general path below does for it, with the stop checks
                # asked for only when the token or the length could stop it
                num_decoded += seq.num_scheduled_tokens
                seq.num_cached_tokens += seq.num_scheduled_tokens
                seq.num_scheduled_tokens = 0
                assert seq.num_cached_tokens == seq.num_tokens
                seq.append_token(token_id)
                limit = max_model_len if seq.max_tokens is None else min(
                    max_model_len, seq.num_prompt_tokens + seq.max_tokens)
                if caching and seq.num_cached_tokens // block_size > len(seq.block_hashes):
                    self.block_manager.cache_computed_blocks(seq)
                if (seq.num_tokens >= limit or token_id in eos_token_ids
                        or token_id in seq.sampling_params.stop_token_ids):
                    stop = self.check_stop(seq, token_id)
                    if stop is not None:
                        self.running.remove(seq)
                        self._finish(seq, *stop)
                        finished.append(seq)
                continue
            num_drafts = len(seq.draft_token_ids)
            seq.draft_token_ids = []
            if seq.is_finished:
                continue  # ended while the step ran (aborted, or stopped by the step before)
            if seq.is_prefill:
                self.stats.num_prompt_tokens_computed += seq.num_scheduled_tokens
            else:
                self.stats.num_decode_tokens_computed += seq.num_scheduled_tokens
            # a draft's K/V counts once the draft is accepted (below)
            seq.num_cached_tokens += seq.num_scheduled_tokens - num_drafts
            seq.num_scheduled_tokens = 0
            if token_id is None:
                self.block_manager.cache_computed_blocks(seq)
                continue
            assert seq.num_cached_tokens == seq.num_tokens
            seq.is_prefill = False
            new_tokens = token_id if isinstance(token_id, list) else [token_id]
            if num_drafts:
                self.spec_stats.observe(num_drafts, len(new_tokens) - 1)
                self.proposer.observe(seq, len(new_tokens) - 1)
            stop = None
            for kept, token in enumerate(new_tokens, start=1):
                if kept > 1:
                    seq.num_cached_tokens += 1  # the token before is an accepted draft: its K/V is verified
                seq.append_token(token)
                stop = self.check_stop(seq, token)
                if stop is not None:
                    del new_tokens[kept:]
                    break
            self.block_manager.cache_computed_blocks(seq)
            if num_drafts:
                self.block_manager.trim(seq)  # the slots of rejected drafts
            if stop is not None:
                self.running.remove(seq)
                self._finish(seq, *stop)
                finished.append(seq)
        self.stats.num_decode_tokens_computed += num_decoded
        return finished

    def check_stop(self, seq: Sequence, token_id: int) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason) if the token just appended ends seq, else None.

        EOS (unless ignore_eos) and stop_token_ids give "stop" (stop_reason: None for EOS, else the token id),
        but only once min_tokens tokens exist (the sampler masks them before that); then the length limits.
        Stop strings are the engine's: they need text (see LLMEngine and the detokenizer).
        """
        params = seq.sampling_params
        if seq.num_completion_tokens > params.min_tokens:
            if not seq.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
            if token_id in params.stop_token_ids:
                return "stop", token_id
        if seq.max_tokens is not None and seq.num_completion_tokens >= seq.max_tokens:
            return "length", None
        if seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End an unfinished sequence now (the engine's stop strings) and free its blocks."""
        self._dequeue(seq)
        self._finish(seq, reason, stop_reason)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.extras.finish_reason = reason
        seq.extras.stop_reason = stop_reason
        seq.num_scheduled_tokens = 0
        self.block_manager.deallocate(seq)
