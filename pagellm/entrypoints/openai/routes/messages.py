"""`POST /v1/messages` (Anthropic's Messages API: one message, or a stream of Anthropic's events) and
`POST /v1/messages/count_tokens`, served on the chat path (serving_messages.py). Their errors are in Anthropic's
shape (anthropic_errors.py), and documented so. A client that disconnects before the response starts cancels the
handler, which aborts its request."""
from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from pagellm.entrypoints.openai import serving_messages
from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_anthropic import (
    AnthropicCountTokensRequest,
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicMessagesRequest,
    AnthropicTokenCount,
)
from pagellm.entrypoints.openai.routes.shared import GENERATION_ERRORS, WITH_BODY_ERRORS, respond
from pagellm.entrypoints.openai.routes.state import ServerStateDep
from pagellm.entrypoints.utils import with_cancellation

router = APIRouter()


def _responses(*errors: HTTPStatus, model: type[BaseModel], streams: bool = False) -> dict[int | str, dict[str, Any]]:
    """openapi.responses, with Anthropic's error body for the errors."""
    documented = responses(*errors, model=model, streams=streams)
    for status, response in documented.items():
        if status != HTTPStatus.OK:
            response["model"] = AnthropicErrorResponse
    return documented


@router.post("/v1/messages", response_model=None,
             responses=_responses(*GENERATION_ERRORS, model=AnthropicMessage, streams=True))
@with_cancellation
async def create_message(request: AnthropicMessagesRequest, raw_request: Request, state: ServerStateDep) -> Response:
    return respond(await serving_messages.create_message(state.chat, request))


@router.post("/v1/messages/count_tokens", response_model=None,
             responses=_responses(*WITH_BODY_ERRORS, model=AnthropicTokenCount))
async def count_tokens(request: AnthropicCountTokensRequest, state: ServerStateDep) -> Response:
    return respond(await serving_messages.count_tokens(state.chat, request))
