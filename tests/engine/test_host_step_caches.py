"""What the host keeps across decode steps equals what a fresh build gives: the sampling tensors (rows joining,
leaving, reordered, turning static once min_tokens is reached) and the block tables of planned steps; and the
engine's tokens do not depend on the caches (seeded requests alone and among others that finish early)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.batch import DecodeBlockTables, _block_tables
from nanovllm.engine.sampling import SamplingTensorCache, build_sampling_tensors
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingTensors

CPU = torch.device("cpu")
VOCAB = 50

SETTINGS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.9, top_p=0.8, seed=11),
    SamplingParams(temperature=1.1, top_k=5, logprobs=3),
    SamplingParams(temperature=0.5, min_p=0.1, seed=5),
    SamplingParams(temperature=0, logprobs=1),
    SamplingParams(temperature=0.8, top_k=1),  # exactly greedy
    SamplingParams(temperature=0.6, min_tokens=2, max_tokens=10),  # bans stop tokens for its first 2 tokens
    SamplingParams(temperature=0.6, presence_penalty=0.5),  # reads its history: built anew every step
]


def make_seqs() -> list[Sequence]:
    seqs = []
    for i, params in enumerate(SETTINGS):
        seq = Sequence([3 + i, 4, 5], params, block_size=4)
        seq.extras.index = i % 2
        seq.extras.min_tokens_stop_ids = (2,) if params.min_tokens else ()
        seqs.append(seq)
    return seqs


def assert_same_tensors(got: SamplingTensors, expected: SamplingTensors) -> None:
    for field in dataclasses.fields(SamplingTensors):
        a, b = getattr(got, field.name), getattr(expected, field.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), field.name
        elif field.name == "generators":
            assert sorted(a) == sorted(b), field.name
        else:
            assert a == b, field.name


def test_cached_sampling_tensors_equal_a_fresh_build_as_rows_change():
    for with_seed_source in (False, True):
        cached_seqs, fresh_seqs = make_seqs(), make_seqs()  # twins: each seeded row's own generator advances once
        cache = SamplingTensorCache()
        cached_source = np.random.default_rng(1) if with_seed_source else None
        fresh_source = np.random.default_rng(1) if with_seed_source else None
        static = list(range(7))
        steps = [static, static, static[1:], static[1:], [6, 0, 3, 2], [6, 0, 3, 2], static + [7], static + [7],
                 static + [7], static + [8], static]
        for step, rows in enumerate(steps):
            got = cache.build([cached_seqs[i] for i in rows], VOCAB, CPU, cached_source)
            expected = build_sampling_tensors([fresh_seqs[i] for i in rows], VOCAB, CPU, fresh_source)
            assert_same_tensors(got, expected)
            if step in (6, 7):  # the min_tokens request generates: its ban ends after two tokens
                cached_seqs[7].append_token(9)
                fresh_seqs[7].append_token(9)
        assert cached_seqs[7].extras.sampling_row is not None  # static once its ban ended, and cached from then on
        assert cached_seqs[8].extras.sampling_row is None


def test_a_hit_reuses_the_tensors_and_draws_new_seeds():
    seqs = make_seqs()[:5]
    cache, source = SamplingTensorCache(), np.random.default_rng(0)
    first, second = cache.build(seqs, VOCAB, CPU, source), cache.build(seqs, VOCAB, CPU, source)
    assert second.temperatures is first.temperatures
    assert not torch.equal(first.row_seeds, second.row_seeds)


def test_kept_block_tables_equal_a_fresh_build():
    seqs = [Sequence(list(range(n)), block_size=4) for n in (3, 9, 17, 4)]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(10 * i, 10 * i + seq.num_blocks))
    tables = DecodeBlockTables()
    np.testing.assert_array_equal(tables.of(seqs), _block_tables(seqs))
    for step in range(12):  # tables grow (one wider than all before), then a sequence leaves, then a reset
        for i, seq in enumerate(seqs):
            if (step + i) % 3 == 0:
                seq.block_table.append(100 + 10 * step + i)
        if step == 8:
            seqs = seqs[1:]
        if step == 10:
            tables.reset()
            seqs[0].block_table = [7, 8]  # what a preemption and a new allocation may do
        np.testing.assert_array_equal(tables.of(seqs), _block_tables(seqs))


def test_seeded_tokens_do_not_depend_on_the_batch_around_them(tiny_qwen3):
    """Asynchronous scheduling (planned steps, the kept tensors and tables) against the synchronous engine: the
    same seeded tokens alone and in a batch whose other requests finish at different steps, some greedy."""
    prompts = [[5 + i, 17, 33 + 3 * i, 8] * (2 + i) for i in range(6)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    others = [SamplingParams(temperature=0.7 if i % 2 else 0, max_tokens=3 + 4 * i, ignore_eos=True, seed=i)
              for i in range(5)]
    kwargs = dict(kvcache_block_size=4, num_kvcache_blocks=256, max_num_seqs=8)
    with LLM(tiny_qwen3, async_scheduling=True, **kwargs) as llm:
        alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
        mixed = llm.generate(prompts, [seeded, *others], use_tqdm=False)
    with LLM(tiny_qwen3, async_scheduling=False, **kwargs) as llm:
        sync = llm.generate(prompts, [seeded, *others], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in sync]
    assert [len(o.outputs[0].token_ids) for o in mixed] == [24] + [3 + 4 * i for i in range(5)]


def test_decode_postprocess_stops_exactly_where_check_stop_says():
    """A decode's token goes through the scheduler's short path; each stop rule ends it at the token where
    ``check_stop`` does, and its full blocks are published to the prefix cache as they fill."""
    from nanovllm.engine.scheduler import Scheduler, SchedulerConfig

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=14, num_kvcache_blocks=64,
                             kvcache_block_size=4)
    sched = Scheduler(config, eos_token_ids={2})
    cases = {  # name: (params, the tokens it is given, (finish_reason, stop_reason) expected, tokens kept)
        "eos": (SamplingParams(max_tokens=20), [5, 6, 2, 7], ("stop", None), 3),
        "ignore_eos": (SamplingParams(max_tokens=4, ignore_eos=True), [2, 2, 2, 2, 2], ("length", None), 4),
        "stop_id": (SamplingParams(max_tokens=20, stop_token_ids=[9]), [5, 9, 7], ("stop", 9), 2),
        "min_tokens": (SamplingParams(max_tokens=20, min_tokens=2), [2, 2, 2, 7], ("stop", None), 3),
        "max_model_len": (SamplingParams(max_tokens=None), [5] * 12, ("length", None), 14 - 5),
    }
    seqs = {}
    for name, (params, _, _, _) in cases.items():
        seqs[name] = Sequence([3, 4, 5, 6, 8], params, block_size=4)
        sched.add(seqs[name])
    for step in range(11):  # the prompts and their first tokens, then decodes only
        batch = sched.schedule()
        assert all(s.is_prefill == (step == 0) for s in batch)
        names = [next(n for n, s in seqs.items() if s is seq) for seq in batch]
        sched.postprocess(batch, [cases[n][1][step] for n in names])
    for name, (_, _, reason, kept) in cases.items():
        seq = seqs[name]
        assert (seq.extras.finish_reason, seq.extras.stop_reason) == reason, name
        assert seq.num_completion_tokens == kept, name
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 64
    assert sched.stats.num_decode_tokens_computed == sum(kept - 1 for *_, kept in cases.values())
    # the longest one published its blocks while decoding: a new request with its first 12 tokens hits them
    again = Sequence(seqs["max_model_len"].token_ids[:12] + [1], SamplingParams(), block_size=4)
    sched.add(again)
    sched.schedule()
    assert again.num_cached_tokens == 12
