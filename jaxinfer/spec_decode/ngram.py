"""N-gram prompt lookup: drafts copied from where the sequence's latest tokens occurred before.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens of the sequence (prompt
and output) are looked for earlier in it; at the first n with a match the tokens that followed
the match are the drafts. Of several matches the latest one whose continuation has all k tokens
wins (else the latest): recent context predicts best, and a match just behind the suffix (a
repeating pattern) would give a short continuation. On the host, vectorised with numpy: one
comparison of every n-token window with the suffix per n.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jaxinfer.core.sequence import Sequence
from jaxinfer.spec_decode.proposer import Proposer


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to k tokens that followed the latest earlier occurrence of tokens' n-token suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length-1-n: each is followed by at least one token, and the
        # suffix itself (starting at length - n) is not among them
        windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= length]
            start = (full[-1] if full.size else hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


class NgramProposer(Proposer):
    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, seqs: Seq[Sequence], max_drafts: Seq[int]) -> list[list[int]]:
        return [
            ngram_lookup(np.asarray(seq.token_ids, np.int64), min(self.k, cap), self.min_n, self.max_n).tolist()
            for seq, cap in zip(seqs, max_drafts)
        ]
