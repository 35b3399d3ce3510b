"""Pydantic models of the pooling endpoints: OpenAI's `/v1/embeddings`, and vLLM's `/score` and `/rerank` (the
Jina/Cohere rerank shape). Requests and responses together: each endpoint's pair is small."""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field

from pagellm.entrypoints.openai.protocol import MAX_BATCH_PROMPTS, Int64, NonNegativeInt64, PositiveInt64, RequestModel
from pagellm.entrypoints.openai.protocol_base import OpenAIBaseModel

Texts = str | Annotated[list[str], Field(max_length=MAX_BATCH_PROMPTS)]


class EmbeddingRequest(RequestModel):
    model: str | None = None
    # One text or token-id list, or a batch of either (OpenAI's shapes).
    input: (list[int] | Annotated[list[list[int]], Field(max_length=MAX_BATCH_PROMPTS)] | str
            | Annotated[list[str], Field(max_length=MAX_BATCH_PROMPTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt64 | None = None  # Matryoshka: the first `dimensions` values, renormalised
    user: str | None = None  # accepted and not used, as by vLLM
    # vLLM's extras.
    add_special_tokens: bool = True
    priority: Int64 = 0
    normalize: bool | None = None  # None: the server's --pooler-config (normalised by default)


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format="base64")


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: EmbeddingUsage


class ScoreRequest(RequestModel):
    """vLLM's /score: `text_1` against `text_2`: one against one, one against many, or pairwise (equal lengths)."""

    model: str | None = None
    text_1: Texts
    text_2: Texts
    priority: Int64 = 0


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: EmbeddingUsage


class RerankRequest(RequestModel):
    """vLLM's /rerank (Jina's and Cohere's shape): the documents most relevant to the query, best first."""

    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(max_length=MAX_BATCH_PROMPTS)]
    top_n: NonNegativeInt64 | None = None  # None or 0: every document
    return_documents: bool = True
    priority: Int64 = 0


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
