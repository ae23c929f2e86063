"""Errors a user can cause name the problem, and leave the engine working."""

import pytest

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=64)


@pytest.mark.parametrize("prompt, words", [
    ([], ["empty"]),
    ("", ["empty"]),
    (list(range(3, 70)), ["67 tokens", "max_model_len is 64"]),
    ([5, 384], ["384", "[0, 384)"]),
    ([5, -1], ["-1"]),
    ([5, "x"], ["'x'"]),
])
def test_bad_prompt_is_a_value_error(llm, prompt, words):
    with pytest.raises(ValueError) as err:
        llm.generate([[7, 8, 9], prompt], GREEDY, use_tqdm=False)
    for w in words:
        assert w in str(err.value)
    assert not llm.has_unfinished_requests(), "a rejected batch queues nothing"
    # the same engine still works
    assert len(llm.generate([[7, 8, 9]], GREEDY, use_tqdm=False)[0].token_ids) == 4


def test_bad_sampling_params(llm):
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[1, 2]], SamplingParams(temperature=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [GREEDY, GREEDY], use_tqdm=False)


def test_stops_at_max_model_len(llm):
    out = llm.generate([list(range(3, 63))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_missing_model_folder_names_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(missing))


def test_unknown_engine_argument(tiny_qwen3):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny_qwen3, max_num_seq=3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(kvcache_block_size=24), "kvcache_block_size"),
    (dict(dtype="float8"), "dtype"),
    (dict(max_model_len=10**6), "max_model_len"),
    (dict(cudagraph_mode="full"), "cudagraph_mode .* 'full'"),
])
def test_bad_engine_arguments(tiny_qwen3, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_qwen3, **kwargs)


def test_request_that_cannot_fit_the_pool(tiny_qwen3):
    small = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=2)
    with pytest.raises(ValueError, match="pool holds 32"):
        small.generate([list(range(3, 40))], GREEDY, use_tqdm=False)


def test_eos_stops_with_reason_stop(llm):
    # greedy from this prompt emits some token t first; declaring t an EOS id must stop there
    first = llm.generate([[9, 9, 9]], GREEDY, use_tqdm=False)[0].token_ids[0]
    saved = set(llm.scheduler.eos_token_ids)
    llm.scheduler.eos_token_ids = {first}
    try:
        out = llm.generate([[9, 9, 9]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    finally:
        llm.scheduler.eos_token_ids = saved
    assert out.token_ids == [first] and out.finish_reason == "stop"
