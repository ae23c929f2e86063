"""The fused-MoE Triton kernels against the torch reference; the expert alignment; the block-size table."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.kernels.fused_moe import (  # noqa: E402
    MoeBlockConfig,
    fused_moe,
    max_padded_rows,
    moe_align,
    pick_block_config,
)
from nanovllm.kernels.fused_moe_reference import fused_moe_reference, moe_align_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def moe_inputs(num_tokens, num_experts, top_k, hidden, intermediate, dtype, seed=0, skewed=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skewed:  # most tokens pick expert 0: one long run, most experts idle
        logits[:, 0] += 6
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids)]


@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, intermediate", [
    (1, 8, 2, 32, 48),     # decode: a row per expert, sizes not multiples of the blocks
    (5, 8, 8, 64, 32),     # every expert chosen by every token
    (37, 16, 4, 48, 80),
])
@pytest.mark.parametrize("config", [MoeBlockConfig(16, 16, 16, 4, 1), MoeBlockConfig(32, 32, 64, 4, 2)])
def test_float32_equals_reference(num_tokens, num_experts, top_k, hidden, intermediate, config):
    args = moe_inputs(num_tokens, num_experts, top_k, hidden, intermediate, torch.float32)
    expected = fused_moe_reference(*args)
    torch.testing.assert_close(fused_moe(*args, config=config), expected, atol=1e-5, rtol=1e-4)


def test_skewed_routing_equals_reference():
    args = moe_inputs(40, 8, 2, 32, 32, torch.float32, seed=1, skewed=True)
    assert (args[4] == 0).sum() >= 30, "the skew sent most tokens to expert 0"
    torch.testing.assert_close(fused_moe(*args, config=MoeBlockConfig(16, 16, 16, 4, 1)), fused_moe_reference(*args),
                               atol=1e-5, rtol=1e-4)


def test_reference_equals_a_dense_loop():
    """The oracle itself: every token's sum over its experts, written the slow obvious way."""
    x, w13, w2, weights, ids = moe_inputs(6, 4, 2, 16, 8, torch.float64)
    expected = torch.zeros_like(x)
    for t in range(6):
        for k in range(2):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            expected[t] += weights[t, k] * (w2[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_moe_reference(x, w13, w2, weights, ids), expected)


ALIGN_CASES = [(1, 8, 2, 16), (33, 16, 4, 16), (64, 4, 2, 32), (50, 6, 3, 16), (300, 128, 8, 64)]


@pytest.mark.parametrize("align", [moe_align, moe_align_reference])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", ALIGN_CASES)
def test_alignment_groups_each_expert_in_whole_blocks(align, num_tokens, num_experts, top_k, block_m):
    ids = torch.rand(num_tokens, num_experts).argsort(-1)[:, :top_k].to(DEVICE)
    sorted_ids, block_experts, num_padded = align(ids, num_experts, block_m)
    assignments = num_tokens * top_k
    assert sorted_ids.numel() == max_padded_rows(assignments, num_experts, block_m)  # depends on shapes only
    used = int(num_padded)
    assert used % block_m == 0 and used <= sorted_ids.numel()
    rows = sorted_ids[:used].view(-1, block_m).cpu()
    experts, flat = block_experts[:used // block_m].cpu(), ids.flatten().cpu()
    real = rows[rows < assignments]
    assert sorted(real.tolist()) == list(range(assignments)), "every assignment appears exactly once"
    assert (sorted_ids[used:] == assignments).all(), "rows past the total are padding"
    for block, expert in zip(rows, experts):
        members = block[block < assignments]
        assert len(members) > 0 and (flat[members] == expert).all(), "a block holds one expert's assignments"
    assert experts.tolist() == sorted(experts.tolist())


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", ALIGN_CASES + [(1000, 128, 8, 16)])
def test_alignment_kernels_equal_the_torch_ops(num_tokens, num_experts, top_k, block_m):
    """Stable within each expert, so the two agree row for row (1000 x 8: several counting chunks)."""
    ids = torch.rand(num_tokens, num_experts).argsort(-1)[:, :top_k].to(DEVICE)
    for ours, reference in zip(moe_align(ids, num_experts, block_m), moe_align_reference(ids, num_experts, block_m)):
        assert torch.equal(ours, reference)


def test_block_table_picks_the_next_tuned_size(tmp_path):
    table = tmp_path / "table.json"
    key = "E=8,I=32,H=64,dtype=bfloat16"
    table.write_text(json.dumps({"Some GPU": {key: {"1": [16, 32, 64, 4, 3], "64": [32, 64, 64, 4, 4],
                                                    "512": [64, 128, 64, 8, 3]}}}))
    pick = lambda n: pick_block_config(n, 8, 32, 64, torch.bfloat16, "Some GPU", str(table))  # noqa: E731
    assert pick(1) == MoeBlockConfig(16, 32, 64, 4, 3)
    assert pick(2) == pick(64) == MoeBlockConfig(32, 64, 64, 4, 4)
    assert pick(4096) == MoeBlockConfig(64, 128, 64, 8, 3)  # beyond the table: its largest entry
    # another device or shape: the heuristic
    assert pick_block_config(1, 8, 32, 64, torch.bfloat16, "Other GPU", str(table)).block_m == 16


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_bf16_close_to_reference(num_tokens):
    args = moe_inputs(num_tokens, 16, 4, 256, 128, torch.bfloat16, seed=2)
    expected = fused_moe_reference(*[a.float() if a.is_floating_point() else a for a in args])
    out = fused_moe(*args).float()
    scale = expected.abs().max()
    assert (out - expected).abs().max() <= 0.02 * scale


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_routing():
    """Captured once, replayed on other routings: no shape or count may be baked into the graph."""
    x, w13, w2, weights, ids = moe_inputs(32, 16, 4, 128, 64, torch.float32, seed=3)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed, skewed in ((4, False), (5, True)):
        new = moe_inputs(32, 16, 4, 128, 64, torch.float32, seed=seed, skewed=skewed)
        x.copy_(new[0]); weights.copy_(new[3]); ids.copy_(new[4])  # noqa: E702
        graph.replay()
        torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)
