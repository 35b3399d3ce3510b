"""Running batch lines: each line of OpenAI's batch format is sent, in process, to the server's own FastAPI app
(httpx over ASGI), so a batch serves every endpoint the app has without a switch per endpoint; lines run
concurrently (bounded) so that the engine batches them. Shared by `pagellm run-batch` and `/v1/batches`."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx
from pydantic import ValidationError
from starlette.routing import Match
from starlette.types import ASGIApp

from pagellm.entrypoints.openai.protocol_batch import (
    BatchLineError,
    BatchRequestInput,
    BatchRequestOutput,
    BatchResponseData,
    random_id,
)

DEFAULT_BATCH_CONCURRENCY = 64
# Batches do not submit batches or upload files.
_REFUSED_PREFIXES = ("/v1/batches", "/v1/files")


def error_line(custom_id: str | None, code: str, message: str) -> BatchRequestOutput:
    return BatchRequestOutput(custom_id=custom_id, response=None, error=BatchLineError(code=code, message=message))


def parse_line(text: str) -> BatchRequestInput | BatchRequestOutput:
    """The line's request, or the error line that answers it."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        return error_line(None, "invalid_json", f"the line is not JSON: {exc}")
    custom_id = raw.get("custom_id") if isinstance(raw, dict) else None
    try:
        return BatchRequestInput.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in exc.errors())
        return error_line(custom_id if isinstance(custom_id, str) else None, "invalid_request",
                          f"the line is not a batch request ({problems}); each line needs custom_id, "
                          f"method \"POST\", url and body.")


class BatchDispatcher:
    """Sends batch lines to `app`. `priority`: set on each body that names none (the server's jobs run at
    SchedulerConfig.background_priority); `headers`: sent with every line (the API key of whoever submitted the
    batch)."""

    def __init__(self, app: ASGIApp, priority: int = 0, headers: dict[str, str] | None = None,
                 max_concurrency: int = DEFAULT_BATCH_CONCURRENCY) -> None:
        self.app = app
        self.priority = priority
        self.headers = headers or {}
        self.max_concurrency = max_concurrency

    def _has_route(self, url: str) -> bool:
        scope = {"type": "http", "path": url, "method": "POST"}
        return any(route.matches(scope)[0] == Match.FULL for route in getattr(self.app, "routes", ()))

    async def run_line(self, client: httpx.AsyncClient, line: BatchRequestInput) -> BatchRequestOutput:
        if line.url.startswith(_REFUSED_PREFIXES) or not self._has_route(line.url):
            return error_line(line.custom_id, "invalid_url", f"url {line.url!r} is not an endpoint of this server "
                              "that a batch line can call; use one such as /v1/chat/completions.")
        if line.body.get("stream"):
            return error_line(line.custom_id, "invalid_request", "stream is not supported in a batch line; "
                              "leave it out or set it to false.")
        body: dict[str, Any] = {"priority": self.priority, **line.body} if self.priority else line.body
        response = await client.post(line.url, json=body, headers=self.headers)
        try:
            payload = response.json()
        except ValueError:
            payload = response.text
        request_id = payload.get("id") if isinstance(payload, dict) else None
        return BatchRequestOutput(custom_id=line.custom_id, response=BatchResponseData(
            status_code=response.status_code, request_id=request_id or random_id("req_"), body=payload))

    async def _answer(self, client: httpx.AsyncClient, text: str) -> BatchRequestOutput:
        parsed = parse_line(text)
        if isinstance(parsed, BatchRequestOutput):
            return parsed
        try:
            return await self.run_line(client, parsed)
        except Exception as exc:  # one line's failure is its error line, never the batch's
            return error_line(parsed.custom_id, "internal_error", f"{type(exc).__name__}: {exc}")

    async def run(self, lines: Iterable[str]) -> AsyncIterator[BatchRequestOutput]:
        """Each line's output, in the order they finish; at most `max_concurrency` lines in flight. Closing the
        iterator (or cancelling its consumer) aborts the lines still running."""
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
            slots = asyncio.Semaphore(self.max_concurrency)

            async def answer(text: str) -> BatchRequestOutput:
                async with slots:
                    return await self._answer(client, text)

            tasks = [asyncio.create_task(answer(text)) for text in lines]
            try:
                for finished in asyncio.as_completed(tasks):
                    yield await finished
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
