"""The embedded SmolLM2-135M-Instruct (float32 here, as in every test): speculation keeps plain greedy tokens."""

from __future__ import annotations

from nanovllm import LLM, SamplingParams

PASSAGE = ("The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper "
           "climbed the spiral stairs and polished the great lens.")
QUESTIONS = ["Repeat the following text exactly:\n\n" + PASSAGE, "Write one sentence about the sea.",
             "What is 12 times 12?"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_greedy_chat_with_speculation_equals_plain():
    kwargs = dict(max_model_len=512, num_kvcache_blocks=16, kvcache_block_size=64)
    plain = LLM(**kwargs)
    prompts = [{"prompt_token_ids": plain.apply_chat_template([{"role": "user", "content": q}])} for q in QUESTIONS]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]
    plain.close()
    spec = LLM(**kwargs, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                             "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, PARAMS, use_tqdm=False)] == expected
    assert [spec.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:1]] == expected[:1]
    assert spec.scheduler.spec_stats.num_accepted_tokens > 0
