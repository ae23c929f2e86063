import math

import pytest

from nanovllm import SamplingParams


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-0.1), ["temperature", "-0.1"]),
    (dict(temperature=math.nan), ["temperature", "nan"]),
    (dict(max_tokens=0), ["max_tokens", "0"]),
    (dict(max_tokens=2.5), ["max_tokens", "2.5"]),
    (dict(ignore_eos="yes"), ["ignore_eos", "yes"]),
])
def test_invalid_values_name_field_and_value(kwargs, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0).temperature == 0
    assert SamplingParams().max_tokens >= 1
