"""Several engines in one process, used in turn; prefix-cache hits that a hash collision cannot fool."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.helpers import hf_greedy

NEW_TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 380, (40,), generator=g).tolist()
    # prompts sharing 8, 16 and 40 leading tokens: hits of whole blocks of 4 and of 16 differ
    return [shared + [7, 8, 9], shared[:8] + [11, 12, 13, 14, 15, 16, 17, 18, 19], shared[:16] + [21] * 9,
            shared[:35], torch.randint(3, 380, (23,), generator=g).tolist()]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    return hf_greedy(tiny_qwen3, PROMPTS, NEW_TOKENS)[0]


def _generate_one_by_one(llm, prompts):
    """One request at a time, so each later prompt finds the earlier ones' blocks in the prefix cache."""
    tokens = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    bm = llm.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    return tokens


def test_two_engines_of_different_block_sizes_used_in_turn_equal_hf(tiny_qwen3, reference):
    with LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=64) as big, \
            LLM(tiny_qwen3, kvcache_block_size=4, num_kvcache_blocks=256, prefix_caching_hash_algo="sha256") as small:
        for _ in range(2):  # the second round hits what the first left in each cache
            assert _generate_one_by_one(big, PROMPTS) == reference
            assert _generate_one_by_one(small, PROMPTS) == reference
        assert big.scheduler.block_manager.num_hit_tokens > 0 and small.scheduler.block_manager.num_hit_tokens > 0
        # each engine's sequences carry its own block size
        assert {big.llm_engine.config.kvcache_block_size, small.llm_engine.config.kvcache_block_size} == {16, 4}


def test_a_forced_hash_collision_serves_no_other_prefixs_blocks(tiny_qwen3, monkeypatch):
    """A block hash that forgets the chain (each block's own tokens only): [B][S] collides with [A][S]. A later
    request [B][S]... must compute S after B, not read the K/V that S got after A."""
    import nanovllm.engine.block_manager as bm_module

    own_tokens = bm_module.xxh64_block_hash
    monkeypatch.setitem(bm_module.BLOCK_HASHES, "xxh64", lambda tokens, prefix=-1: own_tokens(tokens))
    g = torch.Generator().manual_seed(8)
    a, b, s = (torch.randint(3, 380, (16,), generator=g).tolist() for _ in range(3))
    prompts = [a + s + [5], b + s + [6], b + s + [7, 8]]
    expected = hf_greedy(tiny_qwen3, prompts, NEW_TOKENS)[0]
    with LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        assert _generate_one_by_one(llm, prompts) == expected
        assert llm.scheduler.block_manager.num_hit_tokens == 16, "[B] hits for the last prompt, [S] does not"
