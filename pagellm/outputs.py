"""User-facing result types (vLLM's names): one RequestOutput per prompt, one CompletionOutput per sample."""
from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs as the engine carries them: (token ids, logprobs, ranks), the chosen token first, then
# the top-k.
LogprobsEntry = tuple[list[int], list[float], list[int]]


@dataclass
class Logprob:
    """One token's log-probability (from the raw model logits), its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" or "length"; None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # None for the first prompt token, then one dict per prompt token (when prompt_logprobs was requested).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens whose K/V came from the prefix cache (None until the request was first scheduled).
    num_cached_tokens: int | None = None
