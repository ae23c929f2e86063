"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the newest n-gram."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to ``num_tokens`` draft tokens for the sequence ``tokens`` (prompt + output, int64), or an empty array.

    The n-gram is the last n tokens, n from max_n down to min_n; the longest n with an earlier occurrence wins,
    and among its occurrences the latest (closest to the end: the text being copied or edited now). The draft
    is what followed that occurrence. Vectorised: one comparison over the history for the newest token, then
    each longer n only filters the surviving candidates.
    """
    length = len(tokens)
    if length < min_n + 1 or num_tokens < 1:
        return tokens[:0]
    # candidate ends: positions i < length - 1 where tokens[i] equals the newest token
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best = None
    n = 1
    while ends.size and n <= max_n:
        if n >= min_n:
            best = ends
        if n == max_n:
            break
        ends = ends[ends >= n]  # room for one more token before the candidate's start
        ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
        n += 1
    if best is None:
        return tokens[:0]
    start = int(best[-1]) + 1
    return tokens[start:start + num_tokens]
