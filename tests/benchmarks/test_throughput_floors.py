"""benchmarks/throughput.py's floors: what a decode step must read (its weights and its requests' K/V), and the
per-batch-size floor it reports beside each bucket's measured time."""

from __future__ import annotations

import pytest

from benchmarks.throughput import Roofline, StepTimer
from nanovllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(tiny_qwen3, load_format="dummy", num_kvcache_blocks=32, kvcache_block_size=16,
                 async_scheduling=False)
    yield engine
    engine.close()


def test_step_bytes_are_the_weights_and_the_contexts_kv(llm):
    cfg = llm.hf_config
    roofline = Roofline(llm)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = llm.config.kv_torch_dtype.itemsize
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize
    model = getattr(llm.runner, "runner", llm.runner).model
    weights = sum(p.numel() for p in model.parameters())
    if not model.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.numel()
    assert roofline.kv_bytes == kv_bytes > 10
    assert roofline.step_bytes(2, 30) == weights * 2 + 30 * kv_bytes
    assert roofline.step_bytes(0, 0) == weights * 2


def test_each_decode_step_gets_the_floor_of_the_contexts_it_starts_with(llm):
    roofline = Roofline(llm)
    bandwidth = 1e6  # bytes/s: the reported 0.01 ms is then 10 bytes, less than a token's K/V
    timer = StepTimer(llm, roofline, bandwidth)
    try:
        outputs = llm.generate([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]],
                               SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        timer.close()
    assert [len(o.token_ids) for o in outputs] == [4, 4]
    report = timer.report()
    # one prefill step (it gives each request its first token), then three decode steps over 6, 7 and 8 tokens
    assert report["prefill_steps"] == 1 and report["decode_steps"] == 3
    bucket = report["decode_steps_by_batch"]["1-8"]
    expected = sum(roofline.step_bytes(2, 2 * n) for n in (6, 7, 8)) / bandwidth / 3
    assert bucket["floor_ms_per_step"] == pytest.approx(1e3 * expected, abs=0.006)
    assert bucket["floor_fraction"] == pytest.approx(bucket["floor_ms_per_step"] / bucket["ms_per_step"], rel=0.05)
    assert llm.step != timer.step  # closed: the engine's own step again
