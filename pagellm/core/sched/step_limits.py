"""Per-step limits beyond the token budget: which running sequences sit a step out, how many sequence slots and
prompt tokens the step may hold. Two rules set them, and without either the limits are the static ones.

- A latency target (`--target-tpot-ms`): waiting requests start in waves that the planner (tpot_plan.py) finds to
  hold every request's time per output token within HEADROOM of the target, given an online model of the step's time
  (step_time.py); a wave's prompts run in full chunks, and no other request starts until they are in. Running
  sequences always run (a step sat out costs a decoding request a whole gap). Until the model has seen enough steps,
  WARMUP_ROWS rows run.
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
from pagellm.core.sched.queues import num_sequences
from pagellm.core.sched.step_time import StepShape, StepTimeModel
from pagellm.core.sched.tpot_plan import TpotPlanner

HEADROOM = 0.9  # of the target: what the plan holds each request's predicted time per output token to
WARMUP_ROWS = 8  # the cap before the model has data (or max_num_seqs, if lower)


@dataclass
class StepLimits:
    max_seqs: int  # sequence slots of running and newly admitted requests
    deferred: set[str] = field(default_factory=set)  # running sequences that sit this step out
    background_priority: int | None = None  # requests of this priority or lower are background (priority policy)
    background_row_cap: int = sys.maxsize  # rows background requests may take, admissions included
    background_tokens: int = sys.maxsize  # prompt tokens background requests may still take
    background_rows: int = 0
    # A latency target's wave still coming in: its requests' prompts stop a token short of their end, so that they
    # all end in the wave's last step and no first token waits on the wave's other prompts (tpot_plan.py).
    held: set[str] = field(default_factory=set)

    def is_background(self, request: Request) -> bool:
        return self.background_priority is not None and request.priority >= self.background_priority

    def prompt_budget(self, request: Request, tokens_left: int) -> int:
        """Prompt tokens `request` may take this step (the token budget aside) of the `tokens_left` it has to
        compute to its prompt's end."""
        budget = tokens_left - 1 if request.request_id in self.held else sys.maxsize
        return min(budget, self.background_tokens) if self.is_background(request) else budget

    def spend_prompt(self, request: Request, num_tokens: int) -> None:
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
    def __init__(self, config: SchedulerConfig, policy: SchedulingPolicy, max_model_len: int) -> None:
        self.config = config
        self.policy = policy
        background = policy.name == "priority"
        target = config.target_tpot_ms is not None
        self.model = StepTimeModel() if target or background else None
        # The plan aims at HEADROOM of the target: steps scatter around the model's prediction, and it is the p99
        # of the time per output token that must hold the target, not its mean.
        self.planner = (TpotPlanner(HEADROOM * config.target_tpot_ms / 1e3, self.model, config.max_num_batched_tokens,
                                    max_model_len) if target and self.model is not None else None)
        self._starting: set[str] = set()  # the waiting requests of the wave the planner started
        self.background = (BackgroundShare(config.background_priority, self.model, config.max_num_seqs)
                           if background and self.model is not None else None)

    @property
    def active(self) -> bool:
        return self.model is not None

    def observe(self, output: SchedulerOutput, seconds: float) -> None:
        if self.model is not None:
            self.model.observe(StepShape.of(output), seconds)
        if self.planner is not None:
            self.planner.observe(seconds)

    def limits(self, ready: list[tuple[Request, int]], waiting: Iterable[Request]) -> StepLimits:
        """`ready`: the running requests with tokens to compute this step (before the token budget), in running
        order; `waiting`: the waiting queue in admission order."""
        waiting = list(waiting)
        limits = StepLimits(self.config.max_num_seqs)
        order = self.policy.running_order()
        candidates = sorted(ready, key=lambda row: order(row[0])) if order is not None else list(ready)
        if self.background is not None:
            candidates = self._background_share(limits, candidates, waiting)
        if self.planner is not None and self.model is not None:
            self.planner.track([request for request, _ in ready])
            if not self.model.ready:
                limits.max_seqs = min(limits.max_seqs, WARMUP_ROWS)
                candidates = candidates[:WARMUP_ROWS]
            elif waiting:
                self._admit_by_plan(limits, candidates, waiting)
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

    def _admit_by_plan(self, limits: StepLimits, candidates: list[tuple[Request, int]],
                       waiting: list[Request]) -> None:
        """The sequence slots of the running requests and of the waiting ones the plan starts. A wave the token
        budget does not take in one step comes in over the next ones, its prompts held a token short of their end
        until the rest of them fits one step; no other request starts until its prompts are in."""
        assert self.planner is not None
        in_use = sum(num_sequences(request) for request, _ in candidates)
        self._starting.intersection_update(request.request_id for request in waiting)  # started, or gone
        starting = [request for request in waiting if request.request_id in self._starting]
        coming_in = [request for request, _ in candidates if request.num_output_tokens == 0]
        if not starting and not coming_in:
            starting = waiting[:self.planner.admit([request for request, _ in candidates], waiting,
                                                   limits.max_seqs - in_use)]
            self._starting = {request.request_id for request in starting}
        limits.max_seqs = min(limits.max_seqs, in_use + sum(num_sequences(request) for request in starting))
        wave = [*coming_in, *starting]
        left = [request.num_tokens - request.num_computed_tokens for request in wave]
        room = self.config.max_num_batched_tokens - (len(candidates) - len(coming_in))
        if sum(left) > room and max(left, default=0) > 1:  # (held at one token each, the rest would fit)
            limits.held = {request.request_id for request in wave}
