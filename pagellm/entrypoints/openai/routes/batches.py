"""`/v1/batches` (OpenAI's Batch API): create a batch over an uploaded input file, retrieve, list, cancel. The job
runs in the server (serving_batches.py), its lines at the lowest priority."""
from __future__ import annotations

from http import HTTPStatus
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_batch import BatchCreateRequest, BatchList, BatchObject
from pagellm.entrypoints.openai.routes.shared import WITH_BODY_ERRORS, respond
from pagellm.entrypoints.openai.serving_batches import serving_batches

router = APIRouter()
_ERRORS = (HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND)


@router.post("/v1/batches", response_model=None,
             responses=responses(*WITH_BODY_ERRORS, model=BatchObject))
async def create_batch(request: BatchCreateRequest, raw_request: Request) -> Response:
    # Each line is sent with the submitter's key, so the lines pass the same API-key check.
    headers = {"authorization": raw_request.headers["authorization"]} if "authorization" in raw_request.headers \
        else {}
    return respond(serving_batches(raw_request.app).create(request, headers))


@router.get("/v1/batches", response_model=None,
            responses=responses(HTTPStatus.BAD_REQUEST, HTTPStatus.UNAUTHORIZED, model=BatchList))
async def list_batches(raw_request: Request, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> Response:
    return respond(serving_batches(raw_request.app).list_batches(after, limit))


@router.get("/v1/batches/{batch_id}", response_model=None, responses=responses(*_ERRORS, model=BatchObject))
async def retrieve_batch(batch_id: str, raw_request: Request) -> Response:
    return respond(serving_batches(raw_request.app).retrieve(batch_id))


@router.post("/v1/batches/{batch_id}/cancel", response_model=None, responses=responses(*_ERRORS, model=BatchObject))
async def cancel_batch(batch_id: str, raw_request: Request) -> Response:
    return respond(await serving_batches(raw_request.app).cancel(batch_id))
