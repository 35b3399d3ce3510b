"""User-facing result types (vLLM's names): one RequestOutput per prompt, one CompletionOutput per sample; for
pooling requests one PoolingRequestOutput per prompt (EmbeddingRequestOutput as `LLM.embed` returns it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


@dataclass
class PoolingOutput:
    """A pooling request's vector (float32): an embedding, or the logits a classify request asked for."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The result of a pooling request (vLLM's shape): one vector for the prompt, once its prefill is done."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int | None = None  # prompt tokens whose K/V came from the prefix cache


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result per prompt (vLLM's): `.outputs.embedding` is the list of floats."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput.from_base(output.outputs), output.prompt_token_ids,
                   output.finished)
