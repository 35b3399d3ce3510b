"""FrontendStats: what AsyncLLM keeps for metrics. Each engine core's latest scheduler snapshot (written on the
client's threads as CoreUpdates arrive, read by the stat loggers and /metrics), and the stat loggers that receive
the IterationStats of every batch of outputs (on the event loop)."""
from __future__ import annotations

from pagellm.beam_search import BeamSearchOutput
from pagellm.metrics.loggers import LoggingStatLogger
from pagellm.metrics.stats import (
    IterationStats,
    RequestStateStats,
    SchedulerStats,
    StatLoggerBase,
    aggregate_scheduler_stats,
)


class FrontendStats:
    def __init__(self, initial_stats: list[SchedulerStats], log_stats: bool) -> None:
        self.replica_stats = list(initial_stats)  # by engine index
        self.stat_loggers: list[StatLoggerBase] = [LoggingStatLogger(self.scheduler_stats)] if log_stats else []

    def observe(self, engine_index: int, stats: SchedulerStats) -> None:
        self.replica_stats[engine_index] = stats

    def scheduler_stats(self) -> SchedulerStats:
        """All engines' latest snapshots, summed."""
        return aggregate_scheduler_stats(self.replica_stats)

    def record(self, iteration: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(iteration)

    def log(self) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.log()


def record_beam_search(stats: RequestStateStats, output: BeamSearchOutput, now: float,
                       iteration: IterationStats) -> None:
    """A finished beam search counts its prompt, and its best beam's tokens as generated (it has no first token
    to time: its result comes whole)."""
    best = output.sequences[0] if output.sequences else None
    iteration.num_prompt_tokens += stats.num_prompt_tokens
    if best is not None:
        stats.num_generation_tokens = len(best.tokens) - stats.num_prompt_tokens
        iteration.num_generation_tokens += stats.num_generation_tokens
    iteration.finished_requests.append(stats.finished((best.finish_reason if best else None) or "length", now))
