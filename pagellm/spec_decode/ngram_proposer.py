"""Prompt lookup (vLLM's `ngram` method): the drafter finds the longest suffix of the sequence (prompt_lookup_max
down to prompt_lookup_min tokens) that occurred earlier in it, and proposes the tokens that followed its latest
earlier occurrence. It costs one vectorised NumPy scan per n-gram length, no model."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagellm.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens

    def draft(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None) -> tuple[list[int], int]:
        """Up to min(k, max_tokens) draft tokens to follow `token_ids` (prompt and output so far), and the length n of
        the n-gram they follow; ([], 0) when no suffix n-gram recurs."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        if k <= 0 or len(tokens) < self.min_n + 1:
            return [], 0
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows starting before the suffix itself, so that at least one token follows each match.
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start:start + k].tolist(), n
        return [], 0
