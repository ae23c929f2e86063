"""Sampling parameters through the whole engine (LLM.generate, LLMEngine.step/make_output) on a tiny model."""

import pytest
import torch

from nanovllm import LLM, SamplingParams

PROMPTS = ["the quick brown fox", "hello world and", "café naïve"]


def greedy(**kwargs):
    return SamplingParams(temperature=0, ignore_eos=True, **kwargs)


def tokens(outputs):
    return [o.token_ids for o in outputs]


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    expected = tokens(llm.generate(PROMPTS, greedy(max_tokens=10), use_tqdm=False))
    for params in (SamplingParams(top_k=1, max_tokens=10, ignore_eos=True),
                   SamplingParams(top_p=1e-6, max_tokens=10, ignore_eos=True),
                   SamplingParams(temperature=1.5, top_k=1, top_p=0.3, max_tokens=10, ignore_eos=True)):
        assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == expected, params
    # all three kinds side by side in one batch
    mixed = [greedy(max_tokens=10), SamplingParams(top_k=1, max_tokens=10, ignore_eos=True),
             SamplingParams(top_p=1e-6, max_tokens=10, ignore_eos=True)]
    assert tokens(llm.generate(PROMPTS, mixed, use_tqdm=False)) == expected
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=10, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, sampled, use_tqdm=False)) != expected, "sampling does differ"


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_mixed_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["hello world and"], seeded, use_tqdm=False)[0].token_ids
    assert llm.generate(["hello world and"], seeded, use_tqdm=False)[0].token_ids == alone
    long_prompt = list(range(3, 90))
    others = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=5, presence_penalty=1.0, max_tokens=5, ignore_eos=True),
              greedy(max_tokens=3),
              SamplingParams(temperature=1.0, seed=7, min_p=0.1, max_tokens=15, ignore_eos=True)]
    prompts = ["the quick brown fox", long_prompt, "hello world and", "café naïve", [5, 6, 7]]
    params = [others[0], others[1], seeded, others[2], others[3]]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    assert mixed[2].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=43, max_tokens=12, ignore_eos=True)
    assert llm.generate(["hello world and"], other_seed, use_tqdm=False)[0].token_ids != alone


def test_n_samples_share_the_prompt_blocks(tiny_text_model):
    llm = LLM(tiny_text_model, kvcache_block_size=16, num_kvcache_blocks=64)
    prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16 and a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4, "seed + index: four different samples"
    bm = llm.scheduler.block_manager
    assert bm.num_hit_tokens == 3 * 32, "samples 1..3 found both full prompt blocks in the cache"
    assert llm.scheduler.stats.num_prompt_tokens_computed == 40 + 3 * 8
    assert bm.num_free_blocks == bm.num_blocks
    # sample i of n is the request with seed + i
    single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    assert single.token_ids == out.outputs[2].token_ids
    # greedy samples are all equal, and the other fields follow the first sample
    many = llm.generate(["hello world and"], greedy(n=3, max_tokens=5), use_tqdm=False)[0]
    assert len(many.outputs) == 3 and len({tuple(c.token_ids) for c in many.outputs}) == 1
    assert many.text == many.outputs[0].text and many["token_ids"] == many.outputs[0].token_ids


# -- stopping --------------------------------------------------------------------------------------------------
def spanning_stop_string(tokenizer, token_ids):
    """A 2-character string of the output made of one token's last character and the next token's first."""
    texts = [tokenizer.decode(token_ids[:i + 1]) for i in range(len(token_ids))]
    for i in range(2, len(token_ids)):
        before, after = texts[i - 1], texts[i]
        if len(after) > len(before) and before and after.startswith(before):
            stop = before[-1] + after[len(before)]
            if "\ufffd" not in stop and texts[-1].index(stop) == len(before) - 1:
                return stop, i + 1
    raise AssertionError("no usable token boundary")


def test_stop_string_spanning_two_tokens_is_cut_exactly(llm):
    full = llm.generate(["the quick brown fox"], greedy(max_tokens=24), use_tqdm=False)[0]
    stop, num_tokens = spanning_stop_string(llm.tokenizer, full.token_ids)
    out = llm.generate(["the quick brown fox"], greedy(max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    assert out.text == full.text[:full.text.index(stop)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.token_ids == full.token_ids[:num_tokens], "generation stops on the token completing it"
    kept = llm.generate(["the quick brown fox"], greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def stream_texts(llm, prompt, params):
    request_id = llm.add_request(prompt, params)
    texts = []
    while not llm.is_request_finished(request_id):
        llm.step()
        texts.append(llm.make_output(request_id).outputs[0].text)
    final = llm.pop_finished(request_id)
    return texts, final


def test_streamed_text_only_grows_and_never_shows_a_stop_string(llm):
    full = llm.generate(["the quick brown fox"], greedy(max_tokens=24), use_tqdm=False)[0]
    stop, _ = spanning_stop_string(llm.tokenizer, full.token_ids)
    # a longer stop string whose first character appears before it is matched: it must be held back
    longer = full.text[full.text.index(stop) - 1:full.text.index(stop) + len(stop)] if full.text.index(stop) else stop
    params = greedy(max_tokens=24, stop=["never-there", longer])
    texts, final = stream_texts(llm, "the quick brown fox", params)
    offline = llm.generate(["the quick brown fox"], params, use_tqdm=False)[0]
    assert final.text == offline.text == full.text[:full.text.index(longer)]
    assert final.outputs[0].stop_reason == longer
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before), "text only grows"
    assert all(longer not in t for t in texts)
    assert texts[-1] == final.text
    # without stop strings, streaming and offline text agree too
    texts, final = stream_texts(llm, "café naïve", greedy(max_tokens=16))
    assert final.text == llm.generate(["café naïve"], greedy(max_tokens=16), use_tqdm=False)[0].text
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))


def test_stop_token_ids_eos_and_min_tokens(llm):
    full = llm.generate(["hello world and"], greedy(max_tokens=12), use_tqdm=False)[0].token_ids
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    stop_id = full[k]
    out = llm.generate(["hello world and"], greedy(max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.token_ids == full[:k + 1], "the stop token is kept in token_ids"
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    assert out.text == llm.tokenizer.decode(full[:k]), "its text is left out"
    kept = llm.generate(["hello world and"], greedy(max_tokens=12, stop_token_ids=[stop_id],
                                                     include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == llm.tokenizer.decode(full[:k + 1])

    # min_tokens: the stop token cannot come before min_tokens tokens exist
    first = full[0]
    out = llm.generate(["hello world and"], greedy(max_tokens=12, stop_token_ids=[first], min_tokens=3),
                       use_tqdm=False)[0]
    assert first not in out.token_ids[:3] and out.token_ids[0] != first
    assert len(out.token_ids) >= 3

    # EOS: finish_reason "stop" with stop_reason None; min_tokens masks EOS too
    saved = set(llm.scheduler.eos_token_ids)
    llm.scheduler.eos_token_ids = {first}
    try:
        out = llm.generate(["hello world and"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        delayed = llm.generate(["hello world and"], SamplingParams(temperature=0, max_tokens=12, min_tokens=2),
                               use_tqdm=False)[0]
    finally:
        llm.scheduler.eos_token_ids = saved
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.outputs[0].stop_reason is None
    assert first not in delayed.token_ids[:2]


def test_finish_reasons_length_abort_and_max_tokens_none(llm):
    out = llm.generate([list(range(3, 250))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 256 - 247 and out.finish_reason == "length" and out.outputs[0].stop_reason is None
    request_id = llm.add_request("hello world and", SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    llm.step()
    partial = llm.make_output(request_id)
    assert not partial.finished and len(partial.outputs) == 2
    assert llm.abort_request(request_id)
    assert not llm.has_unfinished_requests()
    assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_blocks


# -- logprobs and penalties against Hugging Face ----------------------------------------------------------------
@torch.no_grad()
def hf_logprobs(hf_model, token_ids):
    return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].double(), dim=-1)


@pytest.mark.parametrize("chunked", [False, True])
def test_logprobs_and_prompt_logprobs_equal_log_softmax_of_hf_logits(tiny_text_model, hf_model, chunked):
    # fp32 on the CPU: the comparison is to 1e-4, tighter than bf16 on a GPU allows
    llm = LLM(tiny_text_model, kvcache_block_size=16, num_kvcache_blocks=64, device="cpu",
              max_num_batched_tokens=16 if chunked else 8192)
    prompt = list(range(20, 60))
    params = SamplingParams(temperature=0.9, seed=1, top_k=20, repetition_penalty=1.2, logprobs=3,
                            prompt_logprobs=2, max_tokens=6, ignore_eos=True)
    llm.generate([prompt], greedy(max_tokens=1), use_tqdm=False)  # puts the prompt's blocks in the prefix cache
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    generated = out.token_ids
    reference = hf_logprobs(hf_model, prompt + generated)

    def check(entry, position, token, width):
        ref = reference[position]
        assert abs(entry[token].logprob - ref[token].item()) < 1e-4
        assert entry[token].rank == int((ref > ref[token]).sum()) + 1
        top = ref.topk(width)
        for rank, (t, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1):
            assert abs(entry[t].logprob - value) < 1e-4
            if t != token:
                assert entry[t].rank == rank
        assert set(entry) == set(top.indices.tolist()) | {token}
        assert entry[token].decoded_token == llm.tokenizer.decode([token])

    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == len(generated) == 6
    for j, token in enumerate(generated):
        check(logprobs[j], len(prompt) - 1 + j, token, 3)
    cumulative = sum(reference[len(prompt) - 1 + j, t].item() for j, t in enumerate(generated))
    assert abs(out.outputs[0].cumulative_logprob - cumulative) < 1e-3

    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        check(out.prompt_logprobs[i], i - 1, prompt[i], 2)
    assert llm.generate([prompt], greedy(max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs is None


def reference_penalised_greedy(hf_model, prompt, params, steps):
    """Greedy decoding over HF logits with the penalties applied token by token (vLLM's definitions)."""
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].double().tolist()
        output = ids[len(prompt):]
        for t in set(ids):
            logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
        for t in set(output):
            logits[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
        ids.append(max(range(len(logits)), key=logits.__getitem__))
    return ids[len(prompt):]


def test_penalties_equal_a_direct_reference_computation(llm, hf_model):
    prompt = llm.tokenizer.encode("the quick brown fox")
    plain = llm.generate([prompt], greedy(max_tokens=12), use_tqdm=False)[0].token_ids
    for kwargs in (dict(repetition_penalty=1.5), dict(presence_penalty=1.5, frequency_penalty=0.5),
                   dict(repetition_penalty=0.8, frequency_penalty=1.0)):
        params = greedy(max_tokens=12, **kwargs)
        expected = reference_penalised_greedy(hf_model, prompt, params, 12)
        assert expected != plain, f"{kwargs} changes greedy decoding here, so the comparison means something"
        assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == expected, kwargs


def test_request_output_shape_and_dict_access(llm):
    out = llm.generate("hello world and", SamplingParams(max_tokens=3, logprobs=1, seed=3, ignore_eos=True),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert out["text"] == c.text == out.text and out["token_ids"] == c.token_ids
    assert out["finish_reason"] == "length" and out["outputs"] is out.outputs and out["prompt"] == "hello world and"
    assert c["cumulative_logprob"] == c.cumulative_logprob and out["logprobs"] is c.logprobs
    assert out.prompt_token_ids == llm.tokenizer.encode("hello world and") and out["prompt_logprobs"] is None
    with pytest.raises(KeyError):
        out["nope"]


def test_engine_rejects_what_it_cannot_do(llm):
    with pytest.raises(ValueError, match="stop_token_ids holds 999"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[999]), use_tqdm=False)
    assert not llm.has_unfinished_requests()
