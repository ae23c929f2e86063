"""Rolling back rejected draft tokens keeps the block manager's invariants: a property test of the scheduler."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.engine.batch import needs_sample
from nanovllm.engine.block_manager import NO_HASH
from nanovllm.engine.block_manager import xxh64_block_hash as block_hash
from nanovllm.engine.scheduler import Scheduler, SchedulerConfig
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.spec_decode.config import SpeculativeConfig
from nanovllm.sampling_params import SamplingParams

BLOCK = 4


def check_pool(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_invariants()
    for seq in list(sched.running) + [s for s in sched.waiting if s.block_table]:
        assert not seq.draft_token_ids
        # no block held past the tokens (the newest token may still wait for its block: the next step's)
        assert seq.num_blocks - 1 <= len(seq.block_table) <= seq.num_blocks
        prefix = NO_HASH
        for i, h in enumerate(seq.block_hashes):
            # only verified tokens are published: blocks whose K/V is computed, with their true content
            assert (i + 1) * BLOCK <= seq.num_cached_tokens
            assert h == block_hash(seq.block(i), prefix)
            block = bm.blocks[seq.block_table[i]]
            assert block.hash in (h, NO_HASH) and (block.hash == NO_HASH or block.token_ids == seq.block(i))
            prefix = h
    held = sum(len(s.block_table) for s in list(sched.running) + list(sched.waiting))
    assert held >= len(bm.used_block_ids)  # shared prefix blocks are counted once per holder


@settings(max_examples=40, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(3, 6), min_size=1, max_size=14), min_size=1, max_size=5),
       choices=st.lists(st.integers(0, 1000), min_size=200, max_size=200),
       num_blocks=st.integers(10, 24), budget=st.integers(4, 24))
def test_rollback_keeps_the_pool_consistent(prompts, choices, num_blocks, budget):
    old_block_size = Sequence.block_size
    Sequence.block_size = BLOCK
    try:
        sched = Scheduler(SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64, num_kvcache_blocks=num_blocks,
            kvcache_block_size=BLOCK, speculative=SpeculativeConfig(num_speculative_tokens=3)), {0})
        for prompt in prompts:
            sched.add(Sequence(prompt, SamplingParams(max_tokens=20)))
        draws = iter(choices * 10)
        verified = 0
        for _ in range(2000):
            seqs = sched.schedule()
            if not seqs:
                break
            assert sum(s.num_scheduled_tokens for s in seqs) <= budget
            tokens = []
            for seq in seqs:
                if not needs_sample(seq):
                    tokens.append(None)
                elif seq.draft_token_ids:
                    verified += 1
                    kept = next(draws) % (len(seq.draft_token_ids) + 1)  # accept a random prefix of the draft
                    tokens.append(seq.draft_token_ids[:kept] + [3 + next(draws) % 4])
                else:
                    tokens.append(3 + next(draws) % 4)
            sched.postprocess(seqs, tokens)
            check_pool(sched)
        assert sched.is_finished()
        bm = sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert sched.spec_stats.num_drafts == verified
    finally:
        Sequence.block_size = old_block_size
