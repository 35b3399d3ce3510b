"""A cap on request bodies, as plain ASGI middleware: a body over the limit is refused with 413 at once when its
Content-Length says so, or as soon as a streamed (chunked) body passes the limit, before the app reads more."""
from __future__ import annotations

from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import error_response

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20  # a batch of long prompts fits many times over


class RequestBodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return (f"The request body is larger than {self.max_bytes} bytes (the server's --max-request-body-bytes); "
                f"send a smaller request.")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._message(), HTTPStatus.REQUEST_ENTITY_TOO_LARGE)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the app's body read; the app's HTTPException handler answers 413.
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._message())
            return message

        await self.app(scope, limited_receive, send)
