"""Asynchronous scheduling with text-level features: stop strings, n > 1 samples, prompt logprobs."""

from nanovllm import LLM, SamplingParams
from tests.engine.test_async_scheduling import BLOCK, assert_all_free, spy_ahead


def test_stop_strings_n_samples_and_prompt_logprobs(tiny_text_model):
    """Text-level stops end a request one planned step late on the device, never in what the user sees."""
    base = dict(kvcache_block_size=BLOCK, num_kvcache_blocks=128, max_model_len=256)
    sync = LLM(tiny_text_model, async_scheduling=False, **base)
    ahead = LLM(tiny_text_model, async_scheduling=True, **base)
    launched = spy_ahead(ahead)
    prompts = ["the quick brown fox", "hello world and", "café naïve"]
    probe = sync.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[o.outputs[0].text[4:7]])
              for o in probe]
    params[1] = SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = ahead.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, expected, strict=True):
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in a.outputs] == \
            [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in b.outputs]
    assert [list(d or {}) for d in got[1].prompt_logprobs] == [list(d or {}) for d in expected[1].prompt_logprobs]
    assert got[0].outputs[0].finish_reason == "stop" and isinstance(got[0].outputs[0].stop_reason, str)
    assert launched, "steps were planned ahead"
    assert_all_free(ahead)
