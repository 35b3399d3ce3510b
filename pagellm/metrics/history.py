"""The last few minutes of engine activity, one point per second, for the dashboard's time series.

Fed on the event loop: token counts from every IterationStats (as the other stat loggers), and the scheduler
gauges from the engine thread's latest SchedulerStats snapshot once per second (`sample`, called by the server).
Nothing here touches the engine thread, so the history costs the engine nothing and is there the moment a dashboard
opens, covering the minutes before.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields

from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase

HISTORY_SECONDS = 300
SAMPLE_INTERVAL_S = 1.0


@dataclass(slots=True)
class HistoryPoint:
    time: float  # Unix seconds at the end of the interval
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    kv_cache_usage: float  # 0..1
    num_preemptions: int  # during the interval
    num_running: int
    num_waiting: int


SERIES = tuple(f.name for f in fields(HistoryPoint))


class StatsHistory(StatLoggerBase):
    def __init__(self, scheduler_stats: Callable[[], SchedulerStats], max_points: int = HISTORY_SECONDS) -> None:
        self._scheduler_stats = scheduler_stats
        self._points: deque[HistoryPoint] = deque(maxlen=max_points)
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_sample = time.monotonic()
        self._last_preemptions = scheduler_stats().num_preemptions_total

    def record(self, iteration: IterationStats) -> None:
        self._num_prompt_tokens += iteration.num_prompt_tokens
        self._num_generation_tokens += iteration.num_generation_tokens

    def sample(self) -> None:
        """Close the interval since the last sample: token rates over it and the gauges as they are now."""
        now = time.monotonic()
        elapsed = max(now - self._last_sample, 1e-9)
        stats = self._scheduler_stats()
        self._points.append(HistoryPoint(
            time=round(time.time(), 3), prompt_tokens_per_s=round(self._num_prompt_tokens / elapsed, 2),
            generation_tokens_per_s=round(self._num_generation_tokens / elapsed, 2),
            kv_cache_usage=round(stats.kv_cache_usage, 4),
            num_preemptions=stats.num_preemptions_total - self._last_preemptions,
            num_running=stats.num_running, num_waiting=stats.num_waiting))
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._last_sample = now
        self._last_preemptions = stats.num_preemptions_total

    def series(self, since: float = 0.0) -> dict[str, list[float]]:
        """The points after Unix time `since`, column by column (one list per SERIES name): compact JSON."""
        rows = [astuple(point) for point in self._points if point.time > since]
        return {name: [row[i] for row in rows] for i, name in enumerate(SERIES)}
