"""Which draft tokens a verify step keeps.

A verify step computes, for a request with draft d_1..d_k, the target model's next-token distribution at k + 1
positions: after the newest token, and after each draft prefix d_1..d_j. Every position is sampled as in plain
decoding (its own noise; penalties and min_tokens see the draft prefix as history). The drafts are kept while
each equals the token sampled at its position; the first sample that differs (or, when all match, the sample
after the last draft) is the step's final new token.

This is rejection sampling for a draft that puts all its probability on one token (an n-gram guess): accepting
d with probability p(d) and otherwise sampling from p with d removed and renormalised is the same law as
drawing x ~ p and keeping d when x == d, else taking x. So every output token has exactly the target
distribution given the tokens before it; greedy rows (argmax) give exactly plain greedy decoding's tokens.
"""

from __future__ import annotations


def accepted_tokens(draft: list[int], sampled: list[int]) -> list[int]:
    """The step's new tokens: the longest prefix of ``draft`` that matches ``sampled``, then the next sample.

    sampled: the token sampled at each of the len(draft) + 1 positions.
    """
    assert len(sampled) == len(draft) + 1
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == sampled[num_accepted]:
        num_accepted += 1
    return sampled[:num_accepted + 1]
