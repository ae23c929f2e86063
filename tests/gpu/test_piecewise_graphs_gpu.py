"""Piecewise CUDA graphs (engine/piecewise_graphs.py): steps with a prefill replay the layers between their
attention calls, and compute what the eager forward computes. Run with `pytest -m gpu`."""

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts():
    g = torch.Generator().manual_seed(5)
    # lengths that pad to the ladder's sizes and beyond one chunk of the step budget (chunks mix with decodes)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (3, 17, 40, 100, 130, 255, 300)]


def run_recording(llm: LLM, prompts_: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Greedy tokens, the logits of every step, and how many steps each forward path ran."""
    runner = llm.runner
    logits, calls = [], {"pieces": 0, "eager": 0}
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda h: logits.append(compute_logits(h)) or logits[-1]
    forward = runner._forward
    runner._forward = lambda batch: calls.__setitem__("eager", calls["eager"] + 1) or forward(batch)
    if runner.piecewise is not None:
        replay = runner.piecewise.replay
        runner.piecewise.replay = lambda step: calls.__setitem__("pieces", calls["pieces"] + 1) or replay(step)
    tokens = [o.token_ids for o in llm.generate(prompts_, GREEDY, use_tqdm=False)]
    return tokens, [t.float().cpu() for t in logits], calls


@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise"])
def test_piecewise_graphs_compute_what_the_eager_forward_computes(tiny_qwen3, mode):
    settings = dict(device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256,
                    max_num_batched_tokens=128, enable_prefix_caching=False)
    eager = LLM(tiny_qwen3, cudagraph_mode="none", **settings)
    expected_tokens, expected_logits, eager_calls = run_recording(eager, prompts())
    eager.close()
    llm = LLM(tiny_qwen3, cudagraph_mode=mode, **settings)
    pieces = llm.runner.piecewise
    assert pieces.sizes == [16, 32, 48, 64, 96, 128]
    layers = len(llm.runner.model.attention_layers())
    assert all(len(p.graphs) == layers + 1 and len(p.attentions) == layers for p in pieces.captured.values())
    tokens, logits, calls = run_recording(llm, prompts())
    assert tokens == expected_tokens
    assert len(logits) == len(expected_logits)
    for step, (got, want) in enumerate(zip(logits, expected_logits, strict=True)):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"step {step}: {(got - want).abs().max()}"
    assert calls["eager"] == 0 and eager_calls["pieces"] == 0
    if mode == "piecewise":  # every step
        assert calls["pieces"] == eager_calls["eager"]
    else:  # the steps with a prefill in them; decode-only steps replay whole graphs
        assert 0 < calls["pieces"] < eager_calls["eager"]
    llm.close()


def test_a_step_longer_than_the_largest_graph_runs_eager(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cuda", kvcache_block_size=16, num_kvcache_blocks=256, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    assert llm.runner.piecewise.sizes[-1] == 64
    assert llm.runner.piecewise.fits(64) and not llm.runner.piecewise.fits(65)
    out = llm.generate([[5] * 200], GREEDY, use_tqdm=False)
    assert len(out[0].token_ids) == 8
    llm.close()


def test_bf16_qwen3_shape_with_piecewise_graphs_matches_eager_greedy():
    """The real shape in bf16 (28 layers, the fused q/k norm + RoPE + store kernel writing the static q): the same
    first token for each prompt as the eager forward, and the pieces replay from several ladder sizes."""
    import os
    folder = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "model_configs", "qwen3-0.6b")
    g = torch.Generator().manual_seed(7)
    prompts_ = [torch.randint(100, 10000, (n,), generator=g).tolist() for n in (7, 50, 200, 700)]
    first = {}
    for mode in ("none", "full_and_piecewise"):
        llm = LLM(folder, load_format="dummy", max_model_len=2048, max_num_seqs=16, cudagraph_mode=mode,
                  enable_prefix_caching=False)
        tokens, logits, calls = run_recording(llm, prompts_)
        first[mode] = logits[0]
        if mode != "none":
            assert calls["pieces"] > 0 and calls["eager"] == 0
        llm.close()
    scale = first["none"].abs().max()
    assert (first["full_and_piecewise"] - first["none"]).abs().max() <= 0.02 * scale
