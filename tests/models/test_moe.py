"""Mixture-of-experts families equal Hugging Face transformers on tiny random models, in every engine mode."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.helpers import hf_greedy, save_tiny_model

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts():
    g = torch.Generator().manual_seed(6)
    out = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (1, 15, 17, 60, 140)]
    out.append(out[4][:100] + [5, 6, 7])  # shares 6 full blocks with the prompt before it
    return out


def run(llm, requests):
    outputs = llm.generate(requests, GREEDY, use_tqdm=False)
    bm = llm.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("family, overrides", [
    ("qwen3_moe", {}),  # layer 1 dense by mlp_only_layers
    ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": False}),  # only layer 1 sparse
    ("qwen2_moe", {}),  # shared expert behind its sigmoid gate; q/k/v bias
    ("mixtral", {}),
])
def test_moe_greedy_equals_hf(tmp_path, family, overrides):
    path = save_tiny_model(family, tmp_path / family, seed=3, **overrides)
    expected, _ = hf_greedy(path, prompts(), 8)
    llm = LLM(path, kvcache_block_size=BLOCK, num_kvcache_blocks=128, enable_prefix_caching=False)
    assert run(llm, prompts()) == expected


def test_sparse_layers_follow_the_config(tiny_qwen3_moe):
    from nanovllm.models.decoder import DecoderMLP
    from nanovllm.models.qwen3_moe import SparseMoeBlock
    model = LLM(tiny_qwen3_moe, num_kvcache_blocks=8).runner.model
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoeBlock, DecoderMLP, SparseMoeBlock, SparseMoeBlock]


def test_moe_with_prefix_cache_chunks_and_preemption(tiny_qwen3_moe):
    """Prefix hits, prefills in chunks of 24 tokens and a pool too small for every request at once."""
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 380, (8,), generator=g).tolist()  # one full block of 8 every request shares
    requests = [shared + torch.randint(3, 380, (6,), generator=g).tolist() for _ in range(12)]
    requests.append(torch.randint(3, 380, (60,), generator=g).tolist())
    expected, _ = hf_greedy(tiny_qwen3_moe, requests, 8)
    llm = LLM(tiny_qwen3_moe, kvcache_block_size=8, num_kvcache_blocks=18, max_num_batched_tokens=24)
    assert run(llm, requests) == expected
    assert llm.scheduler.stats.num_preemptions > 0, "the pool forced preemptions"
    assert llm.scheduler.block_manager.num_hit_tokens > 0, "prefix-cache hits happened"


def test_moe_tp2_equals_hf(tiny_qwen3_moe):
    """Each rank holds every expert's half of the intermediate dimension; one all-reduce after the experts.
    With steps planned ahead (asynchronous scheduling, forced on: the CUDA default)."""
    expected, _ = hf_greedy(tiny_qwen3_moe, prompts(), 8)
    llm = LLM(tiny_qwen3_moe, tensor_parallel_size=2, kvcache_block_size=BLOCK, num_kvcache_blocks=64,
              max_num_batched_tokens=64, async_scheduling=True)
    try:
        assert llm.async_scheduling
        assert run(llm, prompts()) == expected
    finally:
        llm.close()


def test_top_k_beyond_experts_is_a_clear_error(tmp_path):
    path = save_tiny_model("qwen3_moe", tmp_path / "m", num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\).*num_experts \(8\)"):
        LLM(path, num_kvcache_blocks=8)
