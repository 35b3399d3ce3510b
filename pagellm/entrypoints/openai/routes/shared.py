"""What several surfaces share: the error statuses each kind of route documents, and turning a serving result
(a pydantic body or a server-sent-events stream) into the HTTP response."""
from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus
from typing import cast

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

# The statuses each kind of route can answer besides 200 (and 500).
GENERATION_ERRORS = (HTTPStatus.BAD_REQUEST, HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND,
                     HTTPStatus.REQUEST_ENTITY_TOO_LARGE, HTTPStatus.SERVICE_UNAVAILABLE)
WITH_BODY_ERRORS = (HTTPStatus.BAD_REQUEST, HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND,
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE)


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends, so a disconnected client's requests are aborted at
    once rather than whenever the generator is garbage-collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # respond() builds these responses from async generators only.
            await cast(AsyncGenerator[str, None], self.body_iterator).aclose()


def respond(result: BaseModel | AsyncIterator[str]) -> Response:
    """A JSON response for a body, a server-sent-events response for a stream."""
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return _ClosingStreamingResponse(result, media_type="text/event-stream")
