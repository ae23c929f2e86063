"""The n-gram proposer against a plain-Python reference, and the speculative_config argument."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.engine.spec_decode.acceptance import accepted_tokens
from nanovllm.engine.spec_decode.config import SpeculativeConfig
from nanovllm.engine.spec_decode.ngram import propose_ngram


def reference_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n-gram ending at the last token with an earlier occurrence; its latest one; what follows."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for end in range(length - 2, n - 2, -1):  # the occurrence's last token, latest first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(1, 5), st.integers(1, 4),
       st.integers(0, 3))
def test_proposals_match_the_reference(tokens, k, min_n, extra):
    max_n = min_n + extra
    got = propose_ngram(np.asarray(tokens, dtype=np.int64), k, min_n, max_n).tolist()
    assert got == reference_proposal(tokens, k, min_n, max_n)


def test_longest_match_wins_over_a_later_shorter_one():
    tokens = [1, 2, 3, 9, 9, 7, 3, 5, 5, 1, 2, 3]
    # "1 2 3" occurred at the start (followed by 9 9); "3" alone last occurred before "5 5"
    assert propose_ngram(np.asarray(tokens), 2, 1, 3).tolist() == [9, 9]
    assert propose_ngram(np.asarray(tokens), 2, 1, 1).tolist() == [5, 5]
    assert propose_ngram(np.asarray(tokens), 2, 4, 4).tolist() == []


def test_acceptance_keeps_the_matching_prefix_and_the_next_sample():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]


def test_config_parsing_and_errors():
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({}) is None
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (3, 2, 1)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.parse({"method": "eagle"})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.parse({"num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer, got 0"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.parse({"method": "ngram", "num_lookahead": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
