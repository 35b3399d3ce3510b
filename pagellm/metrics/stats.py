"""What the serving path measures: per-request timing kept on the asyncio side, and the counts of one batch of
outputs (IterationStats) that every stat logger records."""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from contextvars import ContextVar
from dataclasses import dataclass, field

from pagellm.outputs import PoolingRequestOutput, RequestOutput


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler's queues and the KV block pool."""

    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_blocks: int
    num_preemptions_total: int
    # Prefix cache, cumulative in tokens: looked up and found by new requests (a preempted request finding its
    # own blocks again is counted apart, so it does not inflate the hit rate).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    # Tokens stored / capacity of the blocks requests hold (shared blocks counted once).
    kv_cache_token_efficiency: float = 1.0
    num_used_host_blocks: int = 0
    num_host_blocks: int = 0
    num_swapped_out_blocks_total: int = 0
    num_swapped_in_blocks_total: int = 0
    # Speculative decoding, cumulative (vLLM's spec_decode_*): steps of requests that verified a draft, draft tokens,
    # accepted ones, and per draft position how many drafts had it accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # KV cache groups (one per attention type, core/kv/kv_cache_groups.py): a block of a prompt holds a page of the
    # pool in each group, so the pool holds num_blocks // num_kv_cache_groups blocks of prompts.
    num_kv_cache_groups: int = 1

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


def aggregate_scheduler_stats(replicas: list[SchedulerStats]) -> SchedulerStats:
    """Data-parallel replicas' snapshots as one: counts summed, token efficiency weighted by the blocks held."""
    if len(replicas) == 1:
        return replicas[0]
    total = SchedulerStats(0, 0, 0, 0, 0)
    for stats in replicas:
        for f in dataclasses.fields(SchedulerStats):
            if f.name not in ("kv_cache_token_efficiency", "spec_decode_num_accepted_tokens_per_pos",
                              "num_kv_cache_groups"):
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
        per_pos = (total.spec_decode_num_accepted_tokens_per_pos, stats.spec_decode_num_accepted_tokens_per_pos)
        total.spec_decode_num_accepted_tokens_per_pos = tuple(
            sum(counts[i] for counts in per_pos if i < len(counts)) for i in range(max(map(len, per_pos))))
    total.num_kv_cache_groups = replicas[0].num_kv_cache_groups  # replicas run the same model
    if total.num_used_blocks:
        total.kv_cache_token_efficiency = sum(s.kv_cache_token_efficiency * s.num_used_blocks
                                              for s in replicas) / total.num_used_blocks
    return total


# The API endpoint (its path) a request came through, for request_success_total's `endpoint` label: the server sets it
# for each HTTP request's handler and what it starts (entrypoints/openai/endpoint_label.py); a request's stats read it
# when they are created. "" outside a server.
REQUEST_ENDPOINT: ContextVar[str] = ContextVar("pagellm_request_endpoint", default="")

STEP_PHASES = ("schedule", "prepare_inputs", "forward", "sample", "update", "output_processing")


@dataclass
class StepTimings:
    """Seconds spent in each phase of the engine step, summed over the steps since the last reset: the split
    `pagellm bench latency --step-split` prints. perf_counter around each phase costs well under a microsecond."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    num_steps: int = 0

    def add(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.seconds[phase] += seconds

    def reset(self) -> None:
        self.seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self.num_steps = 0

    def report(self) -> str:
        total = sum(self.seconds.values())
        steps = max(self.num_steps, 1)
        parts = [f"{phase} {1e3 * s / steps:.2f} ms ({100 * s / total if total else 0:.0f}%)"
                 for phase, s in self.seconds.items()]
        return f"{1e3 * total / steps:.2f} ms per step over {self.num_steps} steps: " + ", ".join(parts)


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop", "length", "abort" or "error"
    e2e_latency: float
    queue_time: float | None  # None when the request was never scheduled (or produced no token)
    num_prompt_tokens: int
    num_generation_tokens: int
    endpoint: str = ""  # see REQUEST_ENDPOINT


@dataclass
class IterationStats:
    """Everything one engine step (or one abort) contributed, as seen by the consumers of its outputs."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    engine_index: int = 0  # the engine core (data-parallel replica) these came from


@dataclass
class RequestStateStats:
    """Timing of one request, in time.monotonic() seconds, updated when its outputs reach the event loop."""

    arrival_time: float
    first_scheduled_time: float | None = None  # reported by the engine core with the first output
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    finish_reason: str | None = None
    endpoint: str = field(default_factory=REQUEST_ENDPOINT.get)

    def update(self, output: RequestOutput | PoolingRequestOutput, now: float, iteration: IterationStats) -> None:
        # A pooling request's one output finishes its prefill and generates nothing.
        completions = output.outputs if isinstance(output, RequestOutput) else []
        num_new = sum(len(c.token_ids) for c in completions)
        if self.first_token_time is None:
            # The prompt counts once it has been prefilled, i.e. with the request's first output.
            self.first_token_time = now
            self.num_prompt_tokens = len(output.prompt_token_ids)
            iteration.num_prompt_tokens += self.num_prompt_tokens
            iteration.time_to_first_tokens.append(now - self.arrival_time)
        else:
            iteration.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now
        self.num_generation_tokens += num_new
        iteration.num_generation_tokens += num_new
        for completion in completions:
            self.finish_reason = completion.finish_reason or self.finish_reason
        if output.finished:
            iteration.finished_requests.append(self.finished(self.finish_reason or "stop", now))

    def finished(self, finish_reason: str, now: float) -> FinishedRequestStats:
        # Queue time: from arrival until the scheduler first gave the request a slot in a batch.
        queue_time = None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time
        return FinishedRequestStats(finish_reason, now - self.arrival_time, queue_time, self.num_prompt_tokens,
                                    self.num_generation_tokens, self.endpoint)


class StatLoggerBase(ABC):
    """Receives the IterationStats of every batch of outputs (on the event loop thread)."""

    @abstractmethod
    def record(self, iteration: IterationStats) -> None: ...

    def log(self) -> None:  # noqa: B027 (a hook: only loggers that print override it)
        """Called periodically by the server; loggers that print something override it."""
