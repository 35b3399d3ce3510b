"""Scheduling policies: the order in which waiting requests are admitted, and which running request is preempted
first when the KV pool runs out.

- fcfs: arrival order (a preempted request goes back to the front of the line); the newest running request is
  preempted first.
- priority: lower `priority` first, ties by arrival (vLLM's convention); the lowest-priority running request
  (the newest among equals) is preempted first, and a waiting request that does not fit preempts running ones
  of strictly lower priority.
- short-first: fewest remaining tokens (prompt left to compute + tokens left to generate) first. Ageing bounds
  the wait: a request that has waited `short_first_max_wait` seconds goes ahead of every request that has not,
  and aged requests go in arrival order. So a long request is admitted, at the latest, once it has waited that
  long and the aged requests that arrived before it have been admitted.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from pagellm.config import SchedulerConfig
from pagellm.core.request import Request


def remaining_tokens(request: Request) -> int:
    return (request.num_tokens - request.num_computed_tokens) + (request.max_tokens - request.num_output_tokens)


class SchedulingPolicy:
    def __init__(self, config: SchedulerConfig) -> None:
        self.name = config.scheduling_policy
        self.max_wait = config.short_first_max_wait

    def admission_order(self) -> Callable[[Request], tuple] | None:
        """The sort key that puts the waiting queue in admission order now; None under fcfs (the queue's own
        order)."""
        if self.name == "priority":
            return lambda r: (r.priority, r.arrival_time)
        if self.name == "short-first":
            now = time.monotonic()
            return lambda r: ((0, r.arrival_time, 0) if now - r.arrival_time >= self.max_wait
                              else (1, remaining_tokens(r), r.arrival_time))
        return None

    def running_order(self) -> Callable[[Request], tuple] | None:
        """The sort key that ranks running requests for a step that cannot hold them all (see step_limits.py);
        None under fcfs (admission order)."""
        if self.name == "priority":
            return lambda r: (r.priority, r.arrival_time)
        if self.name == "short-first":
            return lambda r: (remaining_tokens(r), r.arrival_time)
        return None

    def pick_victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt first among `candidates` (in admission order)."""
        if self.name == "priority":
            # max() keeps the first of equals: reversed, so the newest of the lowest priority goes.
            return max(reversed(candidates), key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def outranks(self, waiting: Request, running: Request) -> bool:
        """Whether `waiting` may preempt `running` to get in (priority scheduling only)."""
        return self.name == "priority" and waiting.priority < running.priority
