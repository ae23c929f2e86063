"""SamplingParams: vLLM's fields, defaults, ranges and messages that name the field and the value."""

import dataclasses

import pytest

from nanovllm import SamplingParams
from nanovllm.sampling_params import MAX_LOGPROBS


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
    (dict(top_k=2.5), "top_k must be an integer, got 2.5."),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(temperature=-0.5), "temperature must be non-negative"),
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be less than or equal to max_tokens=4, got 5."),
    (dict(logprobs=MAX_LOGPROBS + 1), f"logprobs must be at most {MAX_LOGPROBS}, got {MAX_LOGPROBS + 1}."),
    (dict(logprobs=-1), f"logprobs must be at most {MAX_LOGPROBS}, got -1."),
    (dict(logprobs=-2), "logprobs must be non-negative, got -2."),
    (dict(prompt_logprobs=21), "prompt_logprobs must be at most 20, got 21."),
    (dict(stop=["ok", ""]), "stop cannot contain an empty string."),
    (dict(stop=[3]), "stop must be a string or a list of strings"),
    (dict(stop="x", detokenize=False), "stop strings are only supported when detokenize is True"),
    (dict(stop_token_ids=[1, "a"]), "stop_token_ids must contain only non-negative integers"),
    (dict(seed=1.5), "seed must be an integer, got 1.5."),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be a bool, got 1."),
])
def test_invalid_values_raise_naming_field_and_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos and not p.include_stop_str_in_output
    assert p.detokenize and p.skip_special_tokens
    assert not p.has_penalties and not p.greedy


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b", "a"]).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == 0, "-1 is accepted as 'off', like 0"
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(max_tokens=None).max_tokens is None
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.greedy and (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def test_fields_are_dataclass_fields():
    # the server maps request bodies onto these names
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {"n", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens", "logprobs",
            "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "include_stop_str_in_output", "skip_special_tokens"} <= names
