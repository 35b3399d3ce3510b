"""POST /score and /rerank (vLLM's; /rerank in Jina's and Cohere's shape): how relevant each text_2 (document) is
to its text_1 (the query), as pooling requests of the engine. What a score is depends on how the model is served:

- `--runner pooling` (an embedding model, such as Qwen3-Embedding): the cosine similarity of the two texts'
  embeddings (each distinct text embedded once), as vLLM scores with embedding models.
- `--runner generate` (a causal LM, such as Qwen3-Reranker): the LM judges the pair. The pair goes into
  Qwen3-Reranker's prompt (below; tokenized as one text, without added special tokens), and the score is the
  softmax over the logits of "yes" and "no" at the prompt's last position, i.e. sigmoid(logit_yes - logit_no). The
  two logits come from a `classify` pooling request (`returned_token_ids`), computed in the same batches as
  everything else; no token is sampled.
"""
from __future__ import annotations

import math
import uuid

import numpy as np

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.async_tokenizer import AsyncTokenizer
from pagellm.entrypoints.openai.errors import OpenAIServingError
from pagellm.entrypoints.openai.protocol_pooling import (
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from pagellm.entrypoints.openai.serving_embedding import PoolingServing
from pagellm.pooling_params import PoolingParams

# Qwen3-Reranker's prompt (its model card), with its default instruction.
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                 "<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def reranker_prompt(query: str, document: str, instruction: str = RERANK_INSTRUCTION) -> str:
    return f"{RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{RERANK_SUFFIX}"


def yes_probability(logit_no: float, logit_yes: float) -> float:
    """softmax([no, yes])[yes], stably."""
    return 1.0 / (1.0 + math.exp(logit_no - logit_yes))


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2, or text_1[i] against text_2[i]."""
    queries = [text_1] if isinstance(text_1, str) else text_1
    documents = [text_2] if isinstance(text_2, str) else text_2
    if not queries or not documents:
        raise OpenAIServingError("text_1 and text_2 must not be empty.", param="text_1" if not queries else "text_2")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        raise OpenAIServingError(f"text_1 must be one text or as many texts as text_2; got {len(queries)} and "
                                 f"{len(documents)}.", param="text_1")
    return list(zip(queries, documents))


class OpenAIServingScore(PoolingServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], tokenizer: AsyncTokenizer) -> None:
        super().__init__(engine, served_model_names, tokenizer)
        self.by_embedding = engine.config.model_config.runner == "pooling"
        vocab = engine.frontend.tokenizer.get_vocab()
        # The LM judge's answer tokens (None: the vocabulary has no such single token).
        self.no_yes_ids = (vocab.get("no"), vocab.get("yes"))

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        model = self.base_model_name(request.model)
        pairs = score_pairs(request.text_1, request.text_2)
        request_id = f"score-{uuid.uuid4().hex}"
        scores, num_tokens = await self._score(pairs, request_id, request.priority, "text_2")
        return ScoreResponse(id=request_id, model=model,
                             data=[ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        model = self.base_model_name(request.model)
        if not request.documents:
            raise OpenAIServingError("documents must not be empty.", param="documents")
        request_id = f"rerank-{uuid.uuid4().hex}"
        scores, num_tokens = await self._score([(request.query, d) for d in request.documents], request_id,
                                               request.priority, "documents")
        ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:request.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=request.documents[i]) if request.return_documents
                                else None)
                   for i in ranked]
        return RerankResponse(id=request_id, model=model, results=results,
                              usage=RerankUsage(total_tokens=num_tokens))

    async def _score(self, pairs: list[tuple[str, str]], request_id: str, priority: int,
                     param: str) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens computed."""
        if self.by_embedding:
            return await self._cosine(pairs, request_id, priority, param)
        return await self._judge(pairs, request_id, priority, param)

    async def _cosine(self, pairs: list[tuple[str, str]], request_id: str, priority: int,
                      param: str) -> tuple[list[float], int]:
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        prompts = await self.prompts(texts, param)
        outputs = await self.encode_batch(prompts, [PoolingParams()] * len(prompts), request_id, priority, param)
        vectors = {text: output.outputs.data.numpy().astype(np.float64) for text, output in zip(texts, outputs)}
        scores = [float(vectors[a] @ vectors[b] / max(np.linalg.norm(vectors[a]) * np.linalg.norm(vectors[b]),
                                                      1e-12))
                  for a, b in pairs]
        return scores, sum(len(output.prompt_token_ids) for output in outputs)

    async def _judge(self, pairs: list[tuple[str, str]], request_id: str, priority: int,
                     param: str) -> tuple[list[float], int]:
        no_id, yes_id = self.no_yes_ids
        if no_id is None or yes_id is None:
            raise OpenAIServingError("This model's vocabulary has no single 'yes' and 'no' tokens, which the LM "
                                     "judge's score reads; serve an embedding model with --runner pooling to score "
                                     "by cosine similarity.", param=param)
        prompts = [self.checked(await self.text_prompt(reranker_prompt(query, document), False, param), param)
                   for query, document in pairs]
        params = PoolingParams(task="classify", returned_token_ids=[no_id, yes_id])
        outputs = await self.encode_batch(prompts, [params] * len(prompts), request_id, priority, param)
        scores = [yes_probability(*map(float, output.outputs.data.tolist())) for output in outputs]
        return scores, sum(len(output.prompt_token_ids) for output in outputs)
