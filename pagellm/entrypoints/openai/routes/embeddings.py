"""`POST /v1/embeddings` (OpenAI's): one vector per input, pooled from the model's final hidden states. A client that
disconnects before the response cancels the handler, which aborts its requests."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_pooling import EmbeddingRequest, EmbeddingResponse
from pagellm.entrypoints.openai.routes.shared import GENERATION_ERRORS, respond
from pagellm.entrypoints.openai.routes.state import ServerStateDep
from pagellm.entrypoints.utils import with_cancellation

router = APIRouter()


@router.post("/v1/embeddings", response_model=None, responses=responses(*GENERATION_ERRORS, model=EmbeddingResponse))
@with_cancellation
async def create_embedding(request: EmbeddingRequest, raw_request: Request, state: ServerStateDep) -> Response:
    return respond(await state.embedding.create_embedding(request))
