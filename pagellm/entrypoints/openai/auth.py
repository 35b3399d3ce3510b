"""API-key check for the OpenAI endpoints, as plain ASGI middleware: it answers 401 before the body is read,
so an unauthenticated client learns nothing about its request. /health, /metrics and /version stay open."""
from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import error_response

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES) and not self._authorized(scope):
            response = error_response("Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                                      HTTPStatus.UNAUTHORIZED)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        return secrets.compare_digest(header, self._expected)
