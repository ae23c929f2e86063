"""Scheduler policy without a model: budgets, chunking, FCFS, preemption order."""

import pytest

from nanovllm import SamplingParams
from nanovllm.engine.batch import needs_sample
from nanovllm.engine.scheduler import Scheduler, SchedulerConfig
from nanovllm.engine.sequence import Sequence, SequenceStatus

BLOCK = 4


pytestmark = pytest.mark.usefixtures("sequence_block_size")


def make(num_blocks=64, budget=16, max_seqs=8):
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=1000,
                             num_kvcache_blocks=num_blocks, kvcache_block_size=BLOCK)
    return Scheduler(config, eos_token_ids={0})


def step(sched):
    seqs = sched.schedule()
    tokens = [7 if needs_sample(s) else None for s in seqs]
    sched.postprocess(seqs, tokens)
    return seqs


def seq(n, max_tokens=3):
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_budget_chunks_the_last_admitted_request_whatever_its_position():
    sched = make(budget=10)
    a, b = seq(4), seq(20)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [s.num_scheduled_tokens for s in batch] == [4, 6], "b (second in the batch) is chunked"
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    sched.postprocess(batch, [7, None])
    batch = sched.schedule()
    assert batch[0] is a and batch[0].num_scheduled_tokens == 1, "decodes come first"
    assert batch[1] is b and b.num_scheduled_tokens == 9


def test_max_num_seqs_and_fcfs():
    sched = make(max_seqs=2)
    seqs = [seq(2) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert first == seqs[:2]
    order = []
    while not sched.is_finished():
        for s in step(sched):
            if s.is_finished:
                order.append(s)
    assert order == seqs
    assert sched.block_manager.num_free_blocks == 64


def test_preempts_newest_and_finishes_everyone():
    sched = make(num_blocks=4, budget=64)
    seqs = [seq(4, max_tokens=4) for _ in range(4)]  # each fills one block, then needs a second
    for s in seqs:
        sched.add(s)
    guard = 0
    while not sched.is_finished():
        step(sched)
        guard += 1
        assert guard < 200, "the scheduler stopped making progress"
    assert sched.stats.num_preemptions > 0
    assert all(s.extras.finish_reason == "length" and s.num_completion_tokens == 4 for s in seqs)
    assert sched.block_manager.num_free_blocks == 4


def test_victim_is_the_newest_running_request():
    sched = make(num_blocks=2, budget=64)
    a, b = seq(4, max_tokens=5), seq(4, max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled, each holding its one block; both now need a second block
    batch = sched.schedule()
    assert batch == [a] and b.status == SequenceStatus.WAITING and sched.waiting[0] is b
    assert b.block_table == [] and b.num_cached_tokens == 0 and b.is_prefill


def test_abort_frees_blocks():
    sched = make()
    a = seq(9)
    sched.add(a)
    step(sched)
    assert sched.abort(a)
    assert a.extras.finish_reason == "abort" and sched.is_finished()
    assert sched.block_manager.num_free_blocks == 64


def test_one_token_chunk_in_the_decode_region_reads_its_own_token():
    """A 1-token prefill chunk counts as a 'decode' row; its input must be the chunk's token, not the last."""
    import torch

    from nanovllm.engine.batch import prepare_batch
    a = seq(10)
    a.block_table = [0, 1, 2]
    a.num_cached_tokens, a.num_scheduled_tokens = 3, 1
    batch = prepare_batch([a], BLOCK, torch.device("cpu"))
    assert batch.meta.num_decodes == 1
    assert batch.input_ids.tolist() == [4] and batch.positions.tolist() == [3]
    assert batch.meta.slot_mapping.tolist() == [3]
    assert batch.sampled_seq_indices == []


def two_sharing_a_prefix(sched):
    """a (9 tokens) and b, whose first two blocks are a's, queued in that order."""
    a = seq(9)
    b = Sequence(list(range(1, 9)) + [50, 51], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(a)
    sched.add(b)
    return a, b


def test_a_request_admitted_later_in_the_step_shares_the_blocks_an_earlier_one_fills():
    sched = make(budget=64)
    a, b = two_sharing_a_prefix(sched)
    assert sched.schedule() == [a, b]
    assert b.num_cached_tokens == 8 and b.num_scheduled_tokens == 2, "b computes only its own tail"
    assert b.block_table[:2] == a.block_table[:2]
    assert a.num_cached_tokens == 0 and a.num_scheduled_tokens == 9, "a computes the shared blocks"


def test_a_chunk_shares_only_the_blocks_it_fills():
    sched = make(budget=6)  # a's first chunk: 6 tokens, one full block and half of the next
    a = seq(9)
    sched.add(a)
    sched.schedule()
    published = {blk.block_id for blk in sched.block_manager.blocks if blk.hash != -1}
    assert published == {a.block_table[0]}


def test_undo_step_takes_back_the_shared_blocks_and_requeues_the_prefills():
    sched = make(budget=64)
    a, b = two_sharing_a_prefix(sched)
    step(sched)  # both prefilled
    c = seq(9)
    d = Sequence(list(range(1, 5)) + [60, 61, 62, 63, 64], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(c)
    sched.add(d)
    cached = dict(sched.block_manager.hash_to_block_id)
    batch = sched.schedule()
    assert batch == [a, b, c, d] and d.num_cached_tokens == 4
    sched.undo_step(batch)  # the step failed: its K/V may be missing
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.hash_to_block_id == cached, "only the blocks published for the failed step are taken back"
    assert list(sched.waiting) == [c, d] and list(sched.running) == [a, b]
    assert c.block_table == [] and d.block_table == [] and c.num_cached_tokens == 0
    assert a.num_scheduled_tokens == 1 and a.num_tokens == 10, "decodes simply repeat"
    while not sched.is_finished():
        step(sched)
    assert all(s.extras.finish_reason == "length" for s in (a, b, c, d))
    assert bm.num_free_blocks == bm.num_blocks
