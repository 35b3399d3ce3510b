"""User-facing pooling parameters (vLLM's `PoolingParams`): what a prefill-only request returns instead of tokens.

`task="embed"` pools the final hidden states of the prompt (the engine's pooling type: LAST, MEAN or CLS; see
`PoolerConfig` in config/model.py), optionally truncated to `dimensions` (Matryoshka) and L2-normalised.
`task="classify"` returns the logits of `returned_token_ids` at the prompt's last position (a causal LM read as a
classifier, as the Qwen3-Reranker yes/no score does).

The engine's input processor resolves the fields left to the engine (`normalize`, and the internal `pooling_type`
and `skip_reading_prefix_cache`) on a copy before the request is queued."""
from __future__ import annotations

from dataclasses import dataclass

from pagellm.exceptions import InvalidRequestError

POOLING_TASKS = ("embed", "classify")


@dataclass
class PoolingParams:
    task: str = "embed"
    dimensions: int | None = None  # embed: keep the first `dimensions` values (then normalise, if normalising)
    normalize: bool | None = None  # embed: L2-normalise (None: the engine's --pooler-config default)
    returned_token_ids: list[int] | None = None  # classify: whose logits at the last position are returned
    # Resolved by the engine, not by users: the pooling type the request runs with, and whether a cached prefix
    # may be reused (only LAST pooling needs no hidden state of the cached positions).
    pooling_type: str | None = None
    skip_reading_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r:.50}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r:.50}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be a boolean, got {self.normalize!r:.50}.")
        if self.task == "classify":
            ids = self.returned_token_ids
            if not ids or not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise InvalidRequestError(f"returned_token_ids must be a non-empty list of token ids for "
                                          f"task='classify', got {ids!r:.80}.")
            if self.dimensions is not None:
                raise InvalidRequestError("dimensions applies to task='embed' only; drop it for task='classify'.")
        elif self.returned_token_ids is not None:
            raise InvalidRequestError("returned_token_ids applies to task='classify' only; drop it for "
                                      "task='embed'.")
