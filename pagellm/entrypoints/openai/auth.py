"""API-key check for the API endpoints, as plain ASGI middleware: it answers before the body is read, so an
unauthenticated client learns nothing about its request. /health, /metrics and /version stay open.

The key travels as `Authorization: Bearer <key>` (OpenAI's clients; the scheme is case-insensitive, RFC 7235) or
as `x-api-key: <key>` (Anthropic's clients), on every protected route. A request may send either or both; each
one sent must hold the key, and a request with more than one header of either name is refused rather than having
one of them picked."""
from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import error_response

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_AUTHORIZATION, _X_API_KEY = b"authorization", b"x-api-key"


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            sent: dict[bytes, list[bytes]] = {_AUTHORIZATION: [], _X_API_KEY: []}
            for name, value in scope["headers"]:
                if name in sent:
                    sent[name].append(value)
            duplicated = [name for name, values in sent.items() if len(values) > 1]
            if duplicated:
                header = "Authorization" if duplicated[0] == _AUTHORIZATION else "x-api-key"
                response = error_response(f"Send exactly one {header} header.", HTTPStatus.BAD_REQUEST)
            elif not any(sent.values()) or not self._authorized(sent[_AUTHORIZATION], sent[_X_API_KEY]):
                response = error_response("Missing or invalid API key: send 'Authorization: Bearer <key>' or "
                                          "'x-api-key: <key>'.", HTTPStatus.UNAUTHORIZED)
            else:
                response = None
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorized(self, authorization: list[bytes], x_api_key: list[bytes]) -> bool:
        bearer_ok = all(self._bearer(header) for header in authorization)
        return bearer_ok and all(secrets.compare_digest(key.strip(), self._expected) for key in x_api_key)

    def _bearer(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._expected)
