"""The periodic stats log line: throughput since the last line, queue lengths and KV cache usage."""
from __future__ import annotations

import time
from collections.abc import Callable

from pagellm.logger import init_logger
from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase

logger = init_logger(__name__)


class LoggingStatLogger(StatLoggerBase):
    """Accumulates token counts between calls to log(); logs only while there is traffic."""

    def __init__(self, scheduler_stats: Callable[[], SchedulerStats]) -> None:
        self._scheduler_stats = scheduler_stats
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_log_time = time.monotonic()

    def record(self, iteration: IterationStats) -> None:
        self._num_prompt_tokens += iteration.num_prompt_tokens
        self._num_generation_tokens += iteration.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_log_time, 1e-9)
        stats = self._scheduler_stats()
        busy = stats.num_running or stats.num_waiting
        if busy or self._num_prompt_tokens or self._num_generation_tokens:
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                        self._num_prompt_tokens / elapsed, self._num_generation_tokens / elapsed,
                        stats.num_running, stats.num_waiting, stats.kv_cache_usage * 100)
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._last_log_time = now
