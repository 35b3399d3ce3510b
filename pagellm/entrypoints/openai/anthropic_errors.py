"""Anthropic's error shape on the Anthropic routes (`/v1/messages...`): `{"type": "error", "error": {"type",
"message"}}`, with its error types per status.

Every error the server answers there (a validation error, a serving error, the API key's 401, the body limit's
413, an unknown path's 404) is first written in OpenAI's shape by the one set of handlers and middleware all
routes share; `AnthropicErrorMiddleware`, outermost, rewrites those answers on these paths, keeping their status,
message and headers. A stream that fails after it started ends with Anthropic's `error` event instead
(serving_messages.py)."""
from __future__ import annotations

import json
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.protocol_anthropic import AnthropicErrorDetail, AnthropicErrorResponse

ANTHROPIC_PATH = "/v1/messages"
# Anthropic's error types (https://docs.anthropic.com/en/api/errors); 503 is its "overloaded" (its own 529).
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error(message: str, status: int) -> AnthropicErrorResponse:
    fallback = "api_error" if status >= HTTPStatus.INTERNAL_SERVER_ERROR else "invalid_request_error"
    return AnthropicErrorResponse(error=AnthropicErrorDetail(type=_ERROR_TYPES.get(HTTPStatus(status), fallback),
                                                             message=message))


def from_openai_error(body: bytes | str, status: int) -> AnthropicErrorResponse:
    """An OpenAI error body (`{"error": {"message", ...}}`) in Anthropic's shape."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace") if isinstance(body, bytes) else body
    return anthropic_error(str(message) or HTTPStatus(status).phrase, status)


class AnthropicErrorMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_anthropic_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None  # an error's response start, held until its body is complete
        body = b""

        async def rewriting_send(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= HTTPStatus.BAD_REQUEST:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            rewritten = from_openai_error(body, start["status"]).model_dump_json().encode()
            headers = [(name, value) for name, value in start["headers"] if name != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(rewritten)).encode())]})
            await send({"type": "http.response.body", "body": rewritten})

        await self.app(scope, receive, rewriting_send)
