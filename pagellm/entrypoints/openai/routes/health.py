"""`GET /health` (200 while the engine runs, else 503 with the error body) and `GET /version`."""
from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from pagellm import __version__
from pagellm.entrypoints.openai.errors import error_response
from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_responses import HealthResponse
from pagellm.entrypoints.openai.routes.state import ServerStateDep

router = APIRouter()


@router.get("/health", responses=responses(HTTPStatus.SERVICE_UNAVAILABLE, model=HealthResponse))
async def health(state: ServerStateDep) -> Response:
    if not state.engine.is_running:
        return error_response("The engine is not running.", HTTPStatus.SERVICE_UNAVAILABLE)
    return JSONResponse(HealthResponse().model_dump())


@router.get("/version", responses=responses())
async def version() -> dict[str, str]:
    return {"version": __version__}
