"""N-gram proposals (prompt lookup decoding): the tokens that followed the last time the sequence's tail appeared.

For a request whose tokens so far (prompt and output) end in n tokens that also occur earlier, the tokens that
followed that earlier occurrence are a guess at what comes next: in summaries, code edits and retrieval-grounded
answers the output often copies spans of the prompt. ``propose`` tries n from ``max_n`` down to ``min_n`` and takes
the longest tail that occurs earlier, at its latest earlier occurrence (the nearest context), and proposes up to
``k`` tokens that followed it (fewer where the sequence ends first). No model runs: the proposals are a point mass
for the verification's rejection sampling (``engine.speculative.rejection``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    k: int  # num_speculative_tokens
    min_n: int = 1  # prompt_lookup_min
    max_n: int = 4  # prompt_lookup_max

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.k}")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"prompt_lookup_min ({self.min_n}) must be at least 1 and at most prompt_lookup_max "
                             f"({self.max_n})")

    def propose(self, tokens: np.ndarray, limit: int | None = None) -> np.ndarray:
        """Up to ``min(k, limit)`` proposed tokens for a sequence ``tokens`` [length] (int); empty where its tail
        occurs nowhere earlier. ``limit``: the room left (max_tokens, the model's length)."""
        room = self.k if limit is None else min(self.k, limit)
        length = len(tokens)
        if room <= 0 or length < self.min_n + 1:
            return tokens[:0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1: every earlier occurrence that has a token after it.
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest earlier occurrence
                return tokens[start:start + room]
        return tokens[:0]
