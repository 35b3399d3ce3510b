"""`POST /tokenize` (a prompt, or chat messages through the chat template) and `POST /detokenize`, on the
server's tokenizer threads."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_responses import DetokenizeResponse, TokenizeResponse
from pagellm.entrypoints.openai.protocol_tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagellm.entrypoints.openai.routes.shared import WITH_BODY_ERRORS, respond
from pagellm.entrypoints.openai.routes.state import ServerStateDep

router = APIRouter()


@router.post("/tokenize", response_model=None, responses=responses(*WITH_BODY_ERRORS, model=TokenizeResponse))
async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest, state: ServerStateDep) -> Response:
    return respond(await state.tokenization.tokenize(request))


@router.post("/detokenize", response_model=None, responses=responses(*WITH_BODY_ERRORS, model=DetokenizeResponse))
async def detokenize(request: DetokenizeRequest, state: ServerStateDep) -> Response:
    return respond(await state.tokenization.detokenize(request))
