"""Which API endpoint each engine request came through, for request_success_total's `endpoint` label: plain ASGI
middleware sets metrics' REQUEST_ENDPOINT to the request's path for its handler and the tasks it starts. A value
already set is kept: a /v1/batches job's lines go through the app again, and count as the batch's."""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.metrics.stats import REQUEST_ENDPOINT

# The routes that run engine requests: their request_success_total series exist from the start, at 0.
ENGINE_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/score", "/v1/score", "/rerank",
                    "/v1/rerank", "/v1/responses", "/v1/messages", "/v1/batches")


class EndpointLabelMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or REQUEST_ENDPOINT.get():
            await self.app(scope, receive, send)
            return
        token = REQUEST_ENDPOINT.set(scope["path"])
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_ENDPOINT.reset(token)
