"""`POST /v1/chat/completions`: chat completion (chat template, tools, structured outputs), as one JSON body or
a server-sent-events stream. A client that disconnects before the response starts cancels the handler, which
aborts its requests."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagellm.entrypoints.openai.protocol_responses import ChatCompletionResponse
from pagellm.entrypoints.openai.routes.shared import GENERATION_ERRORS, respond
from pagellm.entrypoints.openai.routes.state import ServerStateDep
from pagellm.entrypoints.utils import with_cancellation

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None,
             responses=responses(*GENERATION_ERRORS, model=ChatCompletionResponse, streams=True))
@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request,
                                 state: ServerStateDep) -> Response:
    return respond(await state.chat.create_chat_completion(request))
