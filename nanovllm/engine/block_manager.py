"""The KV block pool in pure Python: free list, reference counts and prefix-cache hashes (no torch here)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

import xxhash

from nanovllm.engine.sequence import Sequence

NO_HASH = -1
# content ids: a published block's content gets a fresh one; a block records its parent's (the block before it)
NO_CONTENT = -1  # unpublished (or forgotten) content
ROOT = 0  # the parent of a sequence's first block


def _token_bytes(token_ids: list[int]) -> bytes:
    return array("I", token_ids).tobytes()  # 4 bytes per token id (ids are below 2**32)


def xxh64_block_hash(token_ids: list[int], prefix_hash: int = NO_HASH) -> int:
    """64-bit xxHash of a full block, chained over every token before it: the previous block's hash seeds it."""
    return xxhash.xxh64_intdigest(_token_bytes(token_ids), 0 if prefix_hash == NO_HASH else prefix_hash)


def sha256_block_hash(token_ids: list[int], prefix_hash: int = NO_HASH) -> int:
    """SHA-256 of the previous block's hash and a full block's tokens (the digest as a 256-bit integer)."""
    prefix = b"" if prefix_hash == NO_HASH else prefix_hash.to_bytes(32, "little")
    return int.from_bytes(hashlib.sha256(prefix + _token_bytes(token_ids)).digest(), "little")


# prefix_caching_hash_algo -> block hash function (sha256: vLLM's name for the same choice)
BLOCK_HASHES: dict[str, Callable[[list[int], int], int]] = {"xxh64": xxh64_block_hash, "sha256": sha256_block_hash}


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "content_id", "parent_content_id")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: list[int] = []
        self.content_id = NO_CONTENT
        self.parent_content_id = NO_CONTENT


class BlockManager:
    """Hands out KV blocks to sequences.

    A block is *used* while some sequence holds it (ref_count > 0) and *free* otherwise. A free block keeps
    its prefix hash until it is handed out for new content, so a later request can still hit it; free blocks
    are reused oldest-freed first.

    A prefix-cache hit is exact whatever the hash: a hit on block i needs the cached block's tokens to equal the
    request's, and the block it was computed after (its parent, recorded by content id when it was published) to
    be the block the request matched at i - 1. A hash collision then costs a miss, never another prefix's K/V.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "xxh64"):
        assert num_blocks > 0 and block_size > 0
        if hash_algo not in BLOCK_HASHES:
            raise ValueError(f"prefix_caching_hash_algo must be one of {sorted(BLOCK_HASHES)}, got {hash_algo!r}.")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_block = BLOCK_HASHES[hash_algo]
        self._next_content_id = ROOT + 1
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # insertion-ordered: the oldest freed block comes out first (O(1) removal on a prefix hit)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()
        # prefix-cache statistics, in tokens
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return len(self.used_block_ids) / len(self.blocks)

    # -- internals -----------------------------------------------------------------------------------------
    def _forget_content(self, block: Block) -> None:
        """Drop a block's prefix hash (and the cache's pointer to it): no request can hit it any more."""
        if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash = NO_HASH
        block.token_ids = []
        block.content_id = block.parent_content_id = NO_CONTENT  # its children can no longer match after it

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        self._forget_content(block)  # its old content is about to be overwritten
        block.ref_count = 1
        self.used_block_ids.add(block_id)
        return block_id

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) that hold seq's leading full blocks.

        The block holding the last token is never matched: that token must be computed to get logits.
        """
        if not self.enable_prefix_caching:
            return [], []
        assert seq.block_size == self.block_size, (seq.block_size, self.block_size)
        block_ids, hashes = [], []
        prefix_hash, parent = NO_HASH, ROOT
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block(i)
            h = self.hash_block(tokens, prefix_hash)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_content_id != parent or block.token_ids != tokens:
                break  # a collision (in this block or in one before it): compute it instead
            block_ids.append(block_id)
            hashes.append(h)
            prefix_hash, parent = h, block.content_id
        return block_ids, hashes

    # -- admission -----------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        hit_ids, _ = self._match_prefix(seq)
        hits_on_free = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        return seq.num_blocks - len(hit_ids) + hits_on_free <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens, reusing prefix-cache hits; sets seq.num_cached_tokens."""
        assert not seq.block_table
        hit_ids, hashes = self._match_prefix(seq)
        for block_id in hit_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
                self.used_block_ids.add(block_id)
            block.ref_count += 1
        seq.block_table = hit_ids + [self._take_free_block() for _ in range(seq.num_blocks - len(hit_ids))]
        seq.block_hashes = hashes
        seq.num_cached_tokens = len(hit_ids) * self.block_size
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks go on the free list first, so they are reused before the more shareable prefix.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_cached_tokens = 0

    # -- decode ---------------------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Whether seq's newest token has a slot (an existing one, or a free block)."""
        return len(seq.block_table) >= seq.num_blocks or self.num_free_blocks > 0

    def may_append(self, seq: Sequence) -> None:
        """Give seq a new block when its newest token starts one."""
        if len(seq.block_table) < seq.num_blocks:
            assert len(seq.block_table) + 1 == seq.num_blocks
            seq.block_table.append(self._take_free_block())

    def reserve_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Give seq blocks for its first ``num_tokens`` tokens (a token still in flight included); the caller
        has checked there are enough free blocks."""
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take_free_block())

    def trim(self, seq: Sequence) -> None:
        """Give back seq's blocks past its tokens: those reserved for draft tokens a verify step rejected. They
        were taken for this step and never published (only verified blocks are), so they hold nothing to share
        and go first in the free list."""
        while len(seq.block_table) > seq.num_blocks:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash == NO_HASH
            block.ref_count = 0
            self.used_block_ids.remove(block.block_id)
            self.free_block_ids[block.block_id] = None
            self.free_block_ids.move_to_end(block.block_id, last=False)

    # -- prefix cache ---------------------------------------------------------------------------------------
    def cache_blocks(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Publish seq's full blocks among its first ``num_tokens`` tokens, so later requests can hit them;
        returns the (block id, hash) pairs newly published.

        The scheduler publishes the blocks a step will fill when it schedules the step, so a request admitted
        later in the same step already shares them: every attention backend stores the step's K/V in each layer
        before any request of the step reads the cache. (Decodes are published after their step, once their
        token is known.)
        """
        if not self.enable_prefix_caching:
            return []
        published = []
        prefix_hash = seq.block_hashes[-1] if seq.block_hashes else NO_HASH
        for i in range(len(seq.block_hashes), num_tokens // self.block_size):
            tokens = seq.block(i)
            h = self.hash_block(tokens, prefix_hash)
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH:
                block.hash = h
                block.token_ids = list(tokens)
                block.content_id = self._next_content_id
                self._next_content_id += 1
                # the block before it holds published content too (published in order, held by seq meanwhile)
                block.parent_content_id = self.blocks[seq.block_table[i - 1]].content_id if i else ROOT
                self.hash_to_block_id.setdefault(h, block.block_id)
                published.append((block.block_id, h))
            seq.block_hashes.append(h)
            prefix_hash = h
        return published

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish seq's full blocks whose K/V is computed (after a step)."""
        self.cache_blocks(seq, seq.num_cached_tokens)

    def unpublish(self, published: list[tuple[int, int]]) -> None:
        """Take back blocks published for a step that failed: their K/V was never written."""
        for block_id, h in published:
            block = self.blocks[block_id]
            if block.hash == h:
                self._forget_content(block)

    def reset_prefix_cache(self) -> int:
        """Forget the cached content of every free block (blocks that running sequences hold keep theirs), so no
        later request hits what finished ones left; returns how many blocks were forgotten."""
        cached = [self.blocks[i] for i in self.free_block_ids if self.blocks[i].hash != NO_HASH]
        for block in cached:
            self._forget_content(block)
        return len(cached)

    def check_invariants(self) -> None:
        """For tests: the pool's bookkeeping is consistent."""
        free = set(self.free_block_ids)
        assert not (free & self.used_block_ids), "a block is both free and used"
        assert len(free) + len(self.used_block_ids) == len(self.blocks)
        for block in self.blocks:
            assert block.ref_count >= 0
            assert (block.ref_count > 0) == (block.block_id in self.used_block_ids)
        for h, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].hash == h
        for block in self.blocks:
            assert (block.hash == NO_HASH) == (block.content_id == NO_CONTENT), "a hash without content, or back"
            if block.hash != NO_HASH:
                assert block.parent_content_id < block.content_id, "a parent is published before its children"
