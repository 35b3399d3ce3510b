"""The scheduler's side of method `draft_model`: the draft is made by the worker, which runs the draft model at the
start of the step (worker/draft_proposer.py), so the scheduler sends placeholders. It still picks each request's
draft length (adaptive.py) and reserves the 1 + k slots; the worker returns the draft it verified
(`ModelRunnerOutput.draft_token_ids`), which replaces the placeholders when the step's results are applied."""
from __future__ import annotations

import numpy as np

from pagellm.config import SpeculativeConfig

PLACEHOLDER_TOKEN_ID = -1  # no embedding row: a placeholder that reached a model would fail loudly


class DraftModelSlots:
    """A proposer (as ngram_proposer.NgramProposer) whose draft is k placeholders for the worker to fill."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens

    def draft(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None) -> tuple[list[int], int]:
        """The placeholders, and no match length (the draft model follows no match)."""
        return [PLACEHOLDER_TOKEN_ID] * (self.k if max_tokens is None else min(self.k, max_tokens)), 0
