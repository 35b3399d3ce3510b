"""What the dashboard reads: `GET /v1/engine/state` (one JSON snapshot) and `GET /v1/engine/state/stream`
(server-sent events, one snapshot every `interval` seconds), of engine `engine` (the data-parallel replica; 0 by
default).

A payload is the engine thread's snapshot of its queues and KV pools (core/state_snapshot.py, taken between two
steps), the time it was taken, and the time series of the last minutes (metrics/history.py). Every client shares
one snapshot per MIN_INTERVAL_S, so however many dashboards are open the engine thread builds at most a few
snapshots a second. A stream sends the whole history in its first event and only newer points afterwards.

Both routes sit under /v1/, so with --api-key they need the bearer token like every API route. The dashboard
reads the stream with fetch() (which can send the Authorization header) rather than EventSource (which cannot),
so the key never appears in a URL, where logs and browser history would keep it.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.errors import sse_error
from pagellm.metrics.history import StatsHistory

MIN_INTERVAL_S = 0.25  # at most 4 snapshots a second, whatever the number of clients
DEFAULT_INTERVAL_S = 0.5
MAX_INTERVAL_S = 10.0


class EngineStateFeed:
    def __init__(self, engine: AsyncLLM, history: StatsHistory) -> None:
        self.engine = engine
        self.history = history
        self._lock = asyncio.Lock()
        self._latest: dict[int, dict[str, Any]] = {}  # by engine index
        self._taken_at: dict[int, float] = {}  # time.monotonic() of each _latest

    async def snapshot(self, engine_index: int = 0) -> dict[str, Any]:
        """The engine's state, at most MIN_INTERVAL_S old: {"time": Unix seconds when taken, "engine": ...}."""
        async with self._lock:  # concurrent callers wait for one snapshot instead of each asking for their own
            if time.monotonic() - self._taken_at.get(engine_index, -math.inf) >= MIN_INTERVAL_S:
                engine = await self.engine.get_engine_state(engine_index)
                self._latest[engine_index] = {"time": time.time(), "engine": engine}
                self._taken_at[engine_index] = time.monotonic()
            return self._latest[engine_index]

    async def payload(self, history_since: float = 0.0, engine_index: int = 0) -> dict[str, Any]:
        return {**await self.snapshot(engine_index), "history": self.history.series(history_since)}

    async def stream(self, interval_s: float, engine_index: int = 0) -> AsyncIterator[str]:
        """SSE events until the client goes away (the response then closes this generator); an engine that stops
        ends the stream with an error event."""
        history_since = 0.0
        while True:
            try:
                payload = await self.payload(history_since, engine_index)
            except Exception as exc:  # EngineDeadError: the engine has stopped
                yield sse_error(exc)
                return
            times = payload["history"]["time"]
            history_since = times[-1] if times else history_since
            yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
            await asyncio.sleep(interval_s)
