"""`GET /metrics`: the server's Prometheus registry in the text exposition format (scrapeable even when the engine
has died)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.routes.state import ServerStateDep

router = APIRouter()


@router.get("/metrics", responses=responses(), response_class=PlainTextResponse)
async def prometheus_metrics(state: ServerStateDep) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
