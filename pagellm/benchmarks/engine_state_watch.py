"""`pagellm bench serve --watch-engine-state SECONDS`: keep a dashboard's feed open while the load runs.

It reads pagellm's `/v1/engine/state/stream` the way the /dashboard page does (one stream, an event every SECONDS),
so running the same load with and without it measures what an open dashboard costs the engine.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

import httpx

T = TypeVar("T")


class EngineStateWatch:
    def __init__(self, base_url: str, headers: dict[str, str], interval_s: float) -> None:
        self.url = f"{base_url}/v1/engine/state/stream?interval={interval_s}"
        self.headers = headers
        self.num_events = 0
        self.num_bytes = 0

    async def during(self, work: Awaitable[T]) -> T:
        """Await `work` with the stream open; raises if the stream could not be followed (not a pagellm server, a
        wrong key)."""
        follower = asyncio.create_task(self._follow())
        try:
            return await work
        finally:
            if follower.done() and follower.exception() is not None:
                raise RuntimeError(f"could not follow {self.url}: {follower.exception()}")
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower

    async def _follow(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
            async with client.stream("GET", self.url, headers=self.headers) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        self.num_events += 1
                        self.num_bytes += len(line)
