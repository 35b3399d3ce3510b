"""The periodic stats log line: throughput since the last line, queue lengths, KV cache usage and the prefix cache
hit rate since the last line."""
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
        # The cumulative prefix cache counters at the last line: the hit rate is over the interval since.
        self._last_prefix_cache_queries = 0
        self._last_prefix_cache_hits = 0

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
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                        self._num_prompt_tokens / elapsed, self._num_generation_tokens / elapsed,
                        stats.num_running, stats.num_waiting, stats.kv_cache_usage * 100,
                        self._prefix_cache_hit_rate(stats) * 100)
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._last_log_time = now
        self._last_prefix_cache_queries = stats.prefix_cache_queries
        self._last_prefix_cache_hits = stats.prefix_cache_hits

    def _prefix_cache_hit_rate(self, stats: SchedulerStats) -> float:
        """Hit tokens over queried tokens of the requests admitted since the last line (0 when none were)."""
        queries = stats.prefix_cache_queries - self._last_prefix_cache_queries
        hits = stats.prefix_cache_hits - self._last_prefix_cache_hits
        return hits / queries if queries else 0.0
