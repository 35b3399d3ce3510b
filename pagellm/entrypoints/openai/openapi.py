"""The OpenAPI spec as the server really answers: bad requests are 400 with OpenAI's error body (FastAPI's
default 422 entries are dropped), each route lists the error statuses it can return, and the generation routes
document both their JSON and their server-sent-events bodies."""
from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagellm.entrypoints.openai.protocol_responses import ErrorResponse

# Server-sent events: each event's `data` is one JSON chunk (the response model's streaming form), the last one
# `[DONE]`.
_SSE = {"text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}}}


def responses(*errors: HTTPStatus, model: type[BaseModel] | None = None,
              streams: bool = False) -> dict[int | str, dict[str, Any]]:
    """A route's documented responses: 200 (with `model`; with server-sent events too if it `streams`), the
    given error statuses, and 500, all errors with OpenAI's error body."""
    documented: dict[int | str, dict[str, Any]] = {}
    if model is not None or streams:
        documented[200] = {"model": model, **({"content": _SSE} if streams else {})}
    for status in (*errors, HTTPStatus.INTERNAL_SERVER_ERROR):
        documented[status.value] = {"model": ErrorResponse, "description": status.phrase}
    return documented


def openapi_without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """A replacement for `app.openapi`: FastAPI's spec without the 422 response it adds to every route that
    validates input (this server answers 400) and without the schemas only those used."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in spec.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = spec.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = spec
        return app.openapi_schema

    return openapi
