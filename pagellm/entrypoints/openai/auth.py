"""API-key check for the OpenAI endpoints, as plain ASGI middleware: it answers before the body is read, so an
unauthenticated client learns nothing about its request. /health, /metrics and /version stay open.

The key travels as `Authorization: Bearer <key>`; the scheme is case-insensitive (RFC 7235), and a request with
more than one Authorization header is refused rather than having one of them picked."""
from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import error_response

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            values = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(values) > 1:
                response = error_response("Send exactly one Authorization header.", HTTPStatus.BAD_REQUEST)
            elif not values or not self._authorized(values[0]):
                response = error_response("Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                                          HTTPStatus.UNAUTHORIZED)
            else:
                response = None
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._expected)
