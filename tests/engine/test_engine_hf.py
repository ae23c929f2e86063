"""Greedy tokens and logits equal Hugging Face transformers' on a tiny random Qwen3, in every engine mode."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.helpers import hf_greedy

BLOCK = 16
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_prompts():
    g = torch.Generator().manual_seed(1)
    lengths = [1, BLOCK, BLOCK + 1, 2 * BLOCK, 7, 100, 257, 300]
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[6][:200] + [5, 6, 7])  # shares a long prefix with another prompt
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    return hf_greedy(tiny_qwen3, PROMPTS, NEW_TOKENS)


def run(llm, prompts=PROMPTS):
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outputs)
    bm = llm.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "every KV block is free once all requests finished"
    return [o.token_ids for o in outputs]


def test_greedy_tokens_and_logits_match_hf(tiny_qwen3, reference):
    ref_tokens, ref_logits = reference
    llm = LLM(tiny_qwen3, kvcache_block_size=BLOCK, num_kvcache_blocks=256, enable_prefix_caching=False)
    captured = []
    original = llm.runner.model.compute_logits
    llm.runner.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]
    for prompt, ref_logit in zip(PROMPTS, ref_logits):
        captured.clear()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        ours = captured[0][0].float()
        assert torch.allclose(ours, ref_logit, rtol=1e-4, atol=1e-4 * ref_logit.abs().max().item()), \
            (ours - ref_logit).abs().max()
    llm.runner.model.compute_logits = original
    assert run(llm) == ref_tokens


def test_prefix_cache_hits_give_the_same_tokens(tiny_qwen3, reference):
    llm = LLM(tiny_qwen3, kvcache_block_size=BLOCK, num_kvcache_blocks=256)
    bm = llm.scheduler.block_manager
    assert run(llm) == reference[0]
    # the last prompt shares 200 tokens with prompt 6, admitted earlier in the same step: it reads the 12 full
    # blocks that prompt 6's prefill fills in that very step
    in_step_hits = bm.num_hit_tokens
    assert in_step_hits == 200 // BLOCK * BLOCK
    assert run(llm) == reference[0]  # second run: every full prompt block is cached
    assert bm.num_hit_tokens - in_step_hits >= sum(len(p) - BLOCK for p in PROMPTS if len(p) > BLOCK)
    assert llm.reset_prefix_cache()
    hits_before = bm.num_hit_tokens
    assert run(llm) == reference[0]  # after a reset: computed afresh, only the in-step sharing hits
    assert bm.num_hit_tokens - hits_before == in_step_hits


def test_chunked_prefill_gives_the_same_tokens(tiny_qwen3, reference):
    llm = LLM(tiny_qwen3, kvcache_block_size=BLOCK, num_kvcache_blocks=256, max_num_batched_tokens=40,
              enable_prefix_caching=False)
    steps_with_chunk = []
    original = llm.scheduler.schedule

    def spy():
        seqs = original()
        steps_with_chunk.append(any(s.num_cached_tokens + s.num_scheduled_tokens < s.num_tokens for s in seqs))
        assert sum(s.num_scheduled_tokens for s in seqs) <= 40
        return seqs

    llm.scheduler.schedule = spy
    assert run(llm) == reference[0]
    assert sum(steps_with_chunk) >= 300 // 40, "long prompts were computed in chunks"


def test_preemption_gives_the_same_tokens(tiny_qwen3):
    # 12 one-block prompts that each need a second block after 3 tokens, in a pool of 10 blocks:
    # running requests must give their blocks back and be recomputed later.
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 380, (14,), generator=g).tolist() for _ in range(12)]
    expected, _ = hf_greedy(tiny_qwen3, prompts, NEW_TOKENS)
    llm = LLM(tiny_qwen3, kvcache_block_size=BLOCK, num_kvcache_blocks=10)
    assert run(llm, prompts) == expected
    assert llm.scheduler.stats.num_preemptions > 0


def test_block_size_256_and_max_num_seqs(tiny_qwen3, reference):
    llm = LLM(tiny_qwen3, kvcache_block_size=256, num_kvcache_blocks=16, max_num_seqs=2)
    assert run(llm) == reference[0]


def test_a_failed_step_can_be_retried(tiny_qwen3, reference):
    """A step that raises leaves nothing half-done: blocks shared within it are taken back (their K/V was never
    written) and its prefills start again, so stepping on gives the same tokens."""
    llm = LLM(tiny_qwen3, kvcache_block_size=BLOCK, num_kvcache_blocks=256)
    original = llm.runner.launch

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    llm.runner.launch = broken
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    with pytest.raises(RuntimeError, match="fell over"):
        llm.step()
    bm = llm.scheduler.block_manager
    bm.check_invariants()
    assert not bm.hash_to_block_id, "nothing was computed, so nothing may be hit"
    assert bm.num_free_blocks == bm.num_blocks
    llm.runner.launch = original
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.pop_finished(i).outputs[0].token_ids for i in ids] == reference[0]
