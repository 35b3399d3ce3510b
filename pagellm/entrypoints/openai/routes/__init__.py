"""The OpenAI-compatible API's routes: one module per surface, each with its own `router` (FastAPI's APIRouter).

`ROUTERS` is the one list that `build_app` includes, in this order, which is also the OpenAPI spec's order. A new
endpoint is a new module here with a `router` and one line in `ROUTERS`. Handlers reach the engine and the serving
objects through the `ServerStateDep` dependency (`state.py`), and document their responses with
`openapi.responses(...)`.
"""
from __future__ import annotations

from fastapi import APIRouter

from pagellm.entrypoints.openai.routes import (
    batches,
    chat,
    completions,
    embeddings,
    files,
    health,
    lora,
    messages,
    metrics,
    models,
    responses,
    score,
    tokenization,
    tokenizer_info,
)

ROUTERS: tuple[APIRouter, ...] = (
    health.router,  # /health, /version
    metrics.router,  # /metrics
    models.router,  # /v1/models
    lora.router,  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    completions.router,  # /v1/completions
    chat.router,  # /v1/chat/completions
    messages.router,  # /v1/messages, /v1/messages/count_tokens (Anthropic's API)
    responses.router,  # /v1/responses, /v1/responses/{response_id} (OpenAI's Responses API)
    tokenization.router,  # /tokenize, /detokenize
    tokenizer_info.router,  # /tokenizer_info
    embeddings.router,  # /v1/embeddings
    score.router,  # /score, /rerank (and their /v1 aliases)
    files.router, batches.router,  # /v1/files, /v1/batches (batch jobs over the routes above)
)
