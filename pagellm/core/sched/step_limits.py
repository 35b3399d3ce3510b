"""Per-step limits beyond the token budget: which running sequences sit a step out, how many sequence slots and
prompt tokens the step may hold. Two rules set them, and without either the limits are the static ones.

- A latency target (`--target-tpot-ms`): an online model of the step's time (step_time.py) caps the rows of a step
  so that its predicted time holds the target, and the prompt tokens that share a step with decodes to the time
  left. While work waits, PREFILL_SHARE of the step's variable time (at least PREFILL_MIN_TOKENS tokens) is kept
  for prompt tokens when the cap is set, so that queued requests keep starting.
  The cap aims at HEADROOM of the target (steps scatter around the prediction; the p99 must hold). Sequences that
  have started decoding always run (a step sat out would cost them more than a step over the target), so the cap
  decides who starts: the requests the policy ranks first. It starts at WARMUP_ROWS, until the model has seen
  enough steps, and grows as it learns. At least one sequence always runs.
- Background work (priority policy): requests of priority `background_priority` or lower (batch jobs' lines) take
  what interactive requests leave, by the step time they add (background.py): nothing while one waits (their
  running rows sit the step out), little beside running ones, short steps in a gap of interactive traffic, and the
  static limits once it has been quiet a while.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagellm.config import SchedulerConfig
from pagellm.core.request import Request
from pagellm.core.sched.background import BackgroundShare
from pagellm.core.sched.output import SchedulerOutput
from pagellm.core.sched.policy import SchedulingPolicy
from pagellm.core.sched.step_time import StepShape, StepTimeModel

PREFILL_SHARE = 0.25
HEADROOM = 0.9  # of the target, what the predicted step time is capped at
PREFILL_MIN_TOKENS = 2  # the prompt tokens kept for while work waits, at least
WARMUP_ROWS = 8  # the cap before the model has data (or max_num_seqs, if lower)


@dataclass
class StepLimits:
    max_seqs: int  # sequence slots of running and newly admitted requests
    deferred: set[str] = field(default_factory=set)  # running sequences that sit this step out
    prefill_tokens: int = sys.maxsize  # prompt tokens the step may still take (the token budget aside)
    background_priority: int | None = None  # requests of this priority or lower are background (priority policy)
    background_row_cap: int = sys.maxsize  # rows background requests may take, admissions included
    background_tokens: int = sys.maxsize  # prompt tokens background requests may still take
    background_rows: int = 0

    def is_background(self, request: Request) -> bool:
        return self.background_priority is not None and request.priority >= self.background_priority

    def prompt_budget(self, request: Request) -> int:
        """Prompt tokens `request` may take this step (the token budget aside)."""
        if self.is_background(request):
            return min(self.prefill_tokens, self.background_tokens)
        return self.prefill_tokens

    def spend_prompt(self, request: Request, num_tokens: int) -> None:
        self.prefill_tokens -= num_tokens
        if self.is_background(request):
            self.background_tokens -= num_tokens

    def has_slots(self, slots_in_use: int, num_seqs: int) -> bool:
        """Whether `num_seqs` more sequences fit; a request alone always does (n and beam_width were checked
        against the static max_num_seqs when it was added), so a low cap never stalls the engine."""
        return slots_in_use + num_seqs <= self.max_seqs or slots_in_use == 0

    def may_admit(self, request: Request) -> bool:
        """Whether the waiting `request` may join the step; counts it when it is background."""
        if not self.is_background(request):
            return True
        if self.background_rows >= self.background_row_cap:
            return False
        self.background_rows += 1
        return True


class StepLimiter:
    def __init__(self, config: SchedulerConfig, policy: SchedulingPolicy) -> None:
        self.config = config
        self.policy = policy
        # The cap aims at HEADROOM of the target: steps scatter around the model's prediction, and it is the p99
        # of the time per output token that must hold the target, not its mean.
        self.target_s = HEADROOM * config.target_tpot_ms / 1e3 if config.target_tpot_ms is not None else None
        background = policy.name == "priority"
        self.model = StepTimeModel() if self.target_s is not None or background else None
        self.background = (BackgroundShare(config.background_priority, self.model, config.max_num_seqs)
                           if background and self.model is not None else None)

    @property
    def active(self) -> bool:
        return self.model is not None

    def observe(self, output: SchedulerOutput, seconds: float) -> None:
        if self.model is not None:
            self.model.observe(StepShape.of(output), seconds)

    def limits(self, ready: list[tuple[Request, int]], waiting: Iterable[Request]) -> StepLimits:
        """`ready`: the running requests with tokens to compute this step (before the token budget), in running
        order; `waiting`: the waiting queue in admission order."""
        waiting = list(waiting)
        limits = StepLimits(self.config.max_num_seqs)
        order = self.policy.running_order()
        candidates = sorted(ready, key=lambda row: order(row[0])) if order is not None else list(ready)
        if self.background is not None:
            candidates = self._background_share(limits, candidates, waiting)
        if self.target_s is not None and self.model is not None:
            if not self.model.ready:
                limits.max_seqs = min(limits.max_seqs, WARMUP_ROWS)
                candidates = candidates[:WARMUP_ROWS]
            elif candidates or waiting:
                candidates = self._latency_cap(limits, candidates, waiting)
        selected = {request.request_id for request, _ in candidates}
        limits.deferred = {request.request_id for request, _ in ready if request.request_id not in selected}
        return limits

    def _background_share(self, limits: StepLimits, candidates: list[tuple[Request, int]],
                          waiting: list[Request]) -> list[tuple[Request, int]]:
        assert self.background is not None
        limits.background_priority = self.config.background_priority
        background = [row for row in candidates if limits.is_background(row[0])]
        foreground = [row for row in candidates if not limits.is_background(row[0])]
        limits.background_row_cap, limits.background_tokens = self.background.budget(foreground, background, waiting)
        background = background[:limits.background_row_cap]
        limits.background_rows = len(background)
        kept = {row[0].request_id for row in [*foreground, *background]}
        return [row for row in candidates if row[0].request_id in kept]

    def _latency_cap(self, limits: StepLimits, candidates: list[tuple[Request, int]],
                     waiting: list[Request]) -> list[tuple[Request, int]]:
        """The cap counts the running rows (at their context now), then the waiting requests in admission order (at
        the context they end with), so that no request is admitted that the cap would stall once it decodes."""
        assert self.model is not None and self.target_s is not None
        contexts = [request.num_computed_tokens + num_new for request, num_new in candidates]
        contexts += [r.num_tokens + r.max_tokens - r.num_output_tokens for r in waiting]
        prefills = any(num_new > 1 for _, num_new in candidates)
        reserve = (self.model.extra_tokens_within(PREFILL_SHARE, self.target_s, PREFILL_MIN_TOKENS)
                   if waiting or prefills else 0)
        # A sequence already decoding is never deferred: a step it sits out adds a whole step to its time per
        # output token, more than the over-target steps it spares. The cap limits who starts.
        decoding = sum(1 for request, _ in candidates if request.num_output_tokens > 0)
        cap = max(1, decoding, self.model.rows_within(self.target_s, contexts, reserve))
        limits.max_seqs = min(limits.max_seqs, cap)
        candidates = candidates[:cap]
        decodes = [(request, num_new) for request, num_new in candidates if num_new == 1]
        if decodes:
            # One more row for the prompt chunk itself; its context is counted as its tokens.
            shape = StepShape(len(decodes) + 1, sum(r.num_computed_tokens + 1 for r, _ in decodes), 0)
            limits.prefill_tokens = max(reserve, self.model.max_extra_tokens(self.target_s, shape))
        return candidates
