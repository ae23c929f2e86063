"""The block pool: bookkeeping invariants and prefix-cache correctness under random interleavings."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence

BLOCK = 4


pytestmark = pytest.mark.usefixtures("sequence_block_size")


class SimulatedCache:
    """Stands in for the KV pool: which token's K/V each slot holds."""

    def __init__(self, num_blocks):
        self.slots = [None] * (num_blocks * BLOCK)

    def compute(self, seq):
        """Compute seq's uncomputed tokens (write their 'K/V'), then mark them cached."""
        for pos in range(seq.num_cached_tokens, seq.num_tokens):
            self.slots[seq.block_table[pos // BLOCK] * BLOCK + pos % BLOCK] = seq.token_ids[pos]
        seq.num_cached_tokens = seq.num_tokens

    def assert_view(self, seq):
        for pos in range(seq.num_cached_tokens):
            slot = seq.block_table[pos // BLOCK] * BLOCK + pos % BLOCK
            assert self.slots[slot] == seq.token_ids[pos], "a sequence sees another sequence's K/V"


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "free", "new", "append", "free", "reset"]),
                         st.lists(st.integers(0, 2), min_size=1, max_size=14),
                         st.integers(0, 1000)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 16), caching=st.booleans())
def test_random_interleavings_keep_invariants(ops, num_blocks, caching):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    cache = SimulatedCache(num_blocks)
    live: list[Sequence] = []
    for op, tokens, pick in ops:
        if op == "new":
            seq = Sequence(tokens)
            if bm.can_allocate(seq):
                free_before = bm.num_free_blocks
                bm.allocate(seq)
                assert len(seq.block_table) == seq.num_blocks
                assert seq.num_cached_tokens < seq.num_tokens, "the last token must always be computed"
                assert bm.num_free_blocks <= free_before
                cache.assert_view(seq)
                cache.compute(seq)
                bm.cache_computed_blocks(seq)
                live.append(seq)
        elif op == "append" and live:
            seq = live[pick % len(live)]
            seq.append_token(tokens[0])
            if bm.can_append(seq):
                bm.may_append(seq)
                cache.compute(seq)
                bm.cache_computed_blocks(seq)
            else:
                assert bm.num_free_blocks == 0
                bm.deallocate(seq)
                live.remove(seq)
        elif op == "free" and live:
            bm.deallocate(live.pop(pick % len(live)))
        elif op == "reset":
            bm.reset_prefix_cache()
        bm.check_invariants()
        for seq in live:
            cache.assert_view(seq)
    for seq in live:
        bm.deallocate(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hit_reuses_blocks_and_survives_free():
    bm = BlockManager(8, BLOCK)
    a = Sequence(list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    bm.allocate(a)
    a.num_cached_tokens = a.num_tokens
    bm.cache_computed_blocks(a)
    b = Sequence(list(range(9)))
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 8
    c = Sequence(list(range(8)) + [99])
    bm.allocate(c)  # the freed blocks kept their hashes
    assert c.num_cached_tokens == 8
    assert bm.num_hit_tokens == 16 and bm.num_queried_tokens == 10 + 9 + 9


def test_reset_prefix_cache_forgets_free_blocks_and_keeps_held_ones():
    bm = BlockManager(8, BLOCK)
    finished, running = Sequence(list(range(10))), Sequence(list(range(100, 110)))
    for seq in (finished, running):
        bm.allocate(seq)
        seq.num_cached_tokens = seq.num_tokens
        bm.cache_computed_blocks(seq)
    bm.deallocate(finished)
    assert bm.reset_prefix_cache() == 2  # the finished sequence's two full blocks
    bm.check_invariants()
    again = Sequence(list(range(9)))
    bm.allocate(again)
    assert again.num_cached_tokens == 0, "a reset cache hits nothing a finished request left"
    shares = Sequence(list(range(100, 109)))
    bm.allocate(shares)
    assert shares.num_cached_tokens == 8 and shares.block_table[:2] == running.block_table[:2]


def test_full_hit_still_computes_last_token():
    bm = BlockManager(8, BLOCK)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    a.num_cached_tokens = 8
    bm.cache_computed_blocks(a)
    b = Sequence(list(range(8)))
    bm.allocate(b)
    assert b.num_cached_tokens == 4, "the block holding the last token is recomputed"
    assert b.block_table[1] != a.block_table[1]


def test_uncomputed_blocks_are_not_shared():
    bm = BlockManager(8, BLOCK)
    a = Sequence(list(range(12)))
    bm.allocate(a)  # nothing computed yet
    b = Sequence(list(range(12)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_hash_collision_is_checked_against_tokens(monkeypatch):
    import nanovllm.engine.block_manager as mod
    monkeypatch.setitem(mod.BLOCK_HASHES, "xxh64", lambda tokens, prefix=-1: 7)
    bm = BlockManager(8, BLOCK)
    a = Sequence([1, 1, 1, 1, 5])
    bm.allocate(a)
    a.num_cached_tokens = 5
    bm.cache_computed_blocks(a)
    b = Sequence([2, 2, 2, 2, 5])
    bm.allocate(b)
    assert b.num_cached_tokens == 0, "same hash but other tokens must miss"


def _publish(bm, tokens):
    seq = Sequence(tokens)
    bm.allocate(seq)
    seq.num_cached_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    return seq


@pytest.mark.parametrize("hash_algo", ["xxh64", "sha256"])
def test_a_collision_in_an_earlier_block_serves_no_other_prefix(monkeypatch, hash_algo):
    """A hash that forgets the chain (every block hashes its own tokens only): b's second block collides with
    a's, computed after another first block. A request that follows b's first block must not be served a's."""
    import nanovllm.engine.block_manager as mod
    own_tokens_only = mod.BLOCK_HASHES[hash_algo]
    monkeypatch.setitem(mod.BLOCK_HASHES, hash_algo, lambda tokens, prefix=-1: own_tokens_only(tokens))
    bm = BlockManager(12, BLOCK, hash_algo=hash_algo)
    a = _publish(bm, [1, 1, 1, 1, 5, 5, 5, 5, 9])
    b = _publish(bm, [2, 2, 2, 2, 5, 5, 5, 5, 9])
    assert b.num_cached_tokens == b.num_tokens and bm.hash_to_block_id[b.block_hashes[1]] == a.block_table[1]
    follows_b = Sequence([2, 2, 2, 2, 5, 5, 5, 5, 7])
    bm.allocate(follows_b)
    assert follows_b.block_table[0] == b.block_table[0]
    assert follows_b.num_cached_tokens == 4, "a's [5555] was computed after [1111]: a miss, not a hit"
    assert follows_b.block_table[1] != a.block_table[1]
    follows_a = Sequence([1, 1, 1, 1, 5, 5, 5, 5, 7])
    bm.allocate(follows_a)
    assert follows_a.block_table[:2] == a.block_table[:2], "the true prefix still hits both blocks"
    bm.check_invariants()


def test_a_reused_parent_block_does_not_lead_to_its_old_children(monkeypatch):
    """A block reused for new content gets a new content id: a cached child of its old content cannot follow the
    new content in the same block, even where the hash says so (a hash of each block's own tokens only)."""
    import nanovllm.engine.block_manager as mod
    monkeypatch.setitem(mod.BLOCK_HASHES, "xxh64", lambda tokens, prefix=-1: mod.xxh64_block_hash(tokens))
    bm = BlockManager(3, BLOCK)
    a = _publish(bm, [1, 1, 1, 1, 5, 5, 5, 5, 9])  # blocks [1111] [5555] [9]
    first, second, last = a.block_table
    bm.deallocate(a)
    for block_id in (last, second):  # hand out `first` first, then `last`; `second` keeps its cached [5555]
        bm.free_block_ids.move_to_end(block_id)
    c = _publish(bm, [2, 2, 2, 2, 8])
    assert c.block_table == [first, last]
    bm.deallocate(c)
    b = Sequence([2, 2, 2, 2, 5, 5, 5, 5, 9])
    bm.allocate(b)
    assert b.num_cached_tokens == 4, "[2222] hits; [5555] was computed after [1111], not after [2222]"
    bm.check_invariants()


@pytest.mark.parametrize("hash_algo", ["xxh64", "sha256"])
def test_both_hashes_hit_the_same_prefixes(hash_algo):
    bm = BlockManager(16, BLOCK, hash_algo=hash_algo)
    _publish(bm, list(range(13)))
    seq = Sequence(list(range(12)) + [99])
    bm.allocate(seq)
    assert seq.num_cached_tokens == 12
    bm.check_invariants()


def test_an_unknown_hash_algo_names_the_choices():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo.*sha256.*md5"):
        BlockManager(4, BLOCK, hash_algo="md5")


def test_a_sequence_of_another_block_size_is_refused():
    bm = BlockManager(4, BLOCK)
    with pytest.raises(AssertionError):
        bm.allocate(Sequence(list(range(9)), block_size=BLOCK * 2))
