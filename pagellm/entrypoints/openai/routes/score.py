"""`POST /score` and `POST /rerank` (vLLM's, with their /v1 aliases): relevance scores of text pairs, and documents
ranked against a query (see serving_score.py for what a score is). A client that disconnects before the response
cancels the handler, which aborts its requests."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_pooling import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse
from pagellm.entrypoints.openai.routes.shared import GENERATION_ERRORS, respond
from pagellm.entrypoints.openai.routes.state import ServerStateDep
from pagellm.entrypoints.utils import with_cancellation

router = APIRouter()


@router.post("/score", response_model=None, responses=responses(*GENERATION_ERRORS, model=ScoreResponse))
@router.post("/v1/score", response_model=None, include_in_schema=False)  # vLLM's alias, documented once
@with_cancellation
async def create_score(request: ScoreRequest, raw_request: Request, state: ServerStateDep) -> Response:
    return respond(await state.score.create_score(request))


@router.post("/rerank", response_model=None, responses=responses(*GENERATION_ERRORS, model=RerankResponse))
@router.post("/v1/rerank", response_model=None, include_in_schema=False)
@with_cancellation
async def create_rerank(request: RerankRequest, raw_request: Request, state: ServerStateDep) -> Response:
    return respond(await state.score.create_rerank(request))
