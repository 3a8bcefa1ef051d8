"""Prompt lookup (n-gram) drafts: the tokens that followed the last time the sequence's tail appeared.

vLLM's rule (`v1/spec_decode/ngram_proposer.py`): over the request's prompt and output tokens, find the
longest suffix of n tokens, prompt_lookup_min <= n <= prompt_lookup_max, that also occurs earlier with
at least one token after it; among matches of that length the earliest; propose the (up to) k tokens
that follow it. No match: no draft, and the sequence decodes one token as usual.

    tokens  A B C D A B C  (min 2, max 3, k 2)   suffix "A B C" occurs at 0 -> propose D A
    tokens  A B X A B      (min 2, max 3)        "X A B" nowhere else; "A B" at 0 -> propose X A

The scan is numpy over the whole history per length tried (a sequence of L tokens: at most
(max - min + 1) vectorised passes of L), on the engine thread before the schedule.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens for the sequence `tokens` (prompt then output), [] when no n-gram of
    min_n..max_n tokens at its end occurred before."""
    arr = np.asarray(tokens, dtype=np.int64)  # [L]
    total = arr.shape[0]
    if k <= 0 or total < min_n + 1:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = arr[total - n:]  # [n]
        # start p may run up to total - n - 1: a match there still has a token after it
        starts = total - n  # candidates 0 .. starts - 1
        hit = np.ones(starts, dtype=bool)  # [starts]
        for j in range(n):  # compare column j of every window at once
            hit &= arr[j:j + starts] == suffix[j]
            if not hit.any():
                break
        found = np.flatnonzero(hit)
        if found.size:
            p = int(found[0]) + n
            return arr[p:p + k].tolist()
    return []
