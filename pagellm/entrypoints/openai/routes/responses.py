"""`POST /v1/responses` (OpenAI's Responses API: one response object, or a stream of its events), and
`GET` / `DELETE /v1/responses/{response_id}` for the responses a request stored, served on the chat path
(serving_responses.py). A client that disconnects before the response starts cancels the handler, which aborts its
request."""
from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_responses_api import ResponsesRequest
from pagellm.entrypoints.openai.protocol_responses_api_output import ResponseDeleted, ResponseObject
from pagellm.entrypoints.openai.routes.shared import GENERATION_ERRORS, respond
from pagellm.entrypoints.openai.routes.state import ServerStateDep
from pagellm.entrypoints.utils import with_cancellation

router = APIRouter()
_STORED_ERRORS = (HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND)


@router.post("/v1/responses", response_model=None,
             responses=responses(*GENERATION_ERRORS, model=ResponseObject, streams=True))
@with_cancellation
async def create_response(request: ResponsesRequest, raw_request: Request, state: ServerStateDep) -> Response:
    return respond(await state.responses.create_response(request))


@router.get("/v1/responses/{response_id}", response_model=None,
            responses=responses(*_STORED_ERRORS, model=ResponseObject))
async def retrieve_response(response_id: str, state: ServerStateDep) -> Response:
    return respond(state.responses.retrieve(response_id))


@router.delete("/v1/responses/{response_id}", response_model=None,
               responses=responses(*_STORED_ERRORS, model=ResponseDeleted))
async def delete_response(response_id: str, state: ServerStateDep) -> Response:
    return respond(state.responses.delete(response_id))
