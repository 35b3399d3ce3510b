"""`/v1/files` (OpenAI's Files API, for batch input and output files): upload (multipart, purpose "batch"), list,
retrieve, `GET /v1/files/{file_id}/content`, delete; kept in memory by serving_batches.FileStore."""
from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_batch import FileDeleted, FileList, FileObject
from pagellm.entrypoints.openai.routes.shared import respond
from pagellm.entrypoints.openai.serving_batches import serving_batches

router = APIRouter()
_ERRORS = (HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND)


@router.post("/v1/files", response_model=None,
             responses=responses(HTTPStatus.BAD_REQUEST, HTTPStatus.UNAUTHORIZED,
                                 HTTPStatus.REQUEST_ENTITY_TOO_LARGE, model=FileObject))
async def upload_file(raw_request: Request, file: UploadFile, purpose: str = Form()) -> Response:
    content = await file.read()
    return respond(serving_batches(raw_request.app).files.add(file.filename or "upload.jsonl", purpose, content))


@router.get("/v1/files", response_model=None, responses=responses(HTTPStatus.UNAUTHORIZED, model=FileList))
async def list_files(raw_request: Request, purpose: str | None = None) -> Response:
    return respond(serving_batches(raw_request.app).files.list_files(purpose))


@router.get("/v1/files/{file_id}", response_model=None, responses=responses(*_ERRORS, model=FileObject))
async def retrieve_file(file_id: str, raw_request: Request) -> Response:
    return respond(serving_batches(raw_request.app).files.get(file_id)[0])


@router.get("/v1/files/{file_id}/content", response_class=Response,
            responses={**responses(*_ERRORS), 200: {"content": {"application/octet-stream": {}},
                                                     "description": "The file's bytes"}})
async def file_content(file_id: str, raw_request: Request) -> Response:
    return Response(serving_batches(raw_request.app).files.get(file_id)[1], media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", response_model=None, responses=responses(*_ERRORS, model=FileDeleted))
async def delete_file(file_id: str, raw_request: Request) -> Response:
    return respond(serving_batches(raw_request.app).files.delete(file_id))
