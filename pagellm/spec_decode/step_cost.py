"""What a verify step costs, in plain decode steps, for the adaptive draft length (adaptive.py): a prior measured on
the CPU, scaled online to the steps this engine runs.

The drafter times the steps in which one request decodes alone (batch 1, the case speculation is for): the time
from planning such a step to planning the next one of the same request is that step's time, the engine's work
around the forward pass included. Each draft length k keeps an exponential moving average of its steps' times; a
length seen `MIN_SAMPLES` times costs its measured t_k / t_0, and the others the prior's extra cost
(`prior_cost(k) - 1`) scaled by the mean of the measured (t_k / t_0 - 1) / (prior_cost(k) - 1) over the lengths
seen (the prior has the kernels' steps: rows go eight at a time with AVX-512, four with AVX2). Until
plain and verify steps have both been seen `MIN_SAMPLES` times the prior holds as it is; a gap over `OUTLIER`
times the estimate (the engine idled between requests) is no step time. A length not timed for `STALE_STEPS` lone
steps counts as unmeasured, and starts its average afresh when next drafted: an average taken in a slow spell would
otherwise keep a length that then looks too dear from ever being drafted, so timed, again.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from pagellm.core.sched.output import ScheduledRequest

EMA_WEIGHT = 0.1
# kernels/linear_cpu.c: WIDE_MAX_M (the AVX-512 group kernel; AVX2's FUSED_MAX_M is 4, and there the measured costs
# show the 5th row's second pass), PACKED_FUSED_MAX_ROWS
ROWS_PER_PASS, SMALL_M_ROWS = 8, 8
MIN_SAMPLES = 3
STALE_STEPS = 500
OUTLIER = 10.0


def prior_cost(k: int) -> float:
    """A verify step with k drafts in decode steps at batch 1 on the CPU's one-call decode step: the small-M matmul
    kernels take the 1 + k rows in one pass up to 8 (AVX-512), decoding the weights once per pass (0.66 of a plain
    step) and paying each row's arithmetic (0.33); past 8 rows the tile path costs about 0.88 a row. Measured on the
    default model, 2 threads, AMD EPYC (Zen 5), medians over the editing prompts of `pagellm bench spec` with each
    length forced: k = 1..7 cost 1.27-1.29, 1.50-1.63, 1.77-1.92, 2.11-2.33, 2.43-2.75, 3.03-3.40, 3.32-3.71
    (2026-11-27, two runs); with four rows a pass, k = 4 cost 2.52 (the 5th row started a second pass)."""
    rows = k + 1
    if rows > SMALL_M_ROWS:
        return 0.88 * rows
    return 0.01 + 0.66 * -(-rows // ROWS_PER_PASS) + 0.33 * rows


class VerifyCosts:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[int, float] = {}  # draft length -> moving average of its lone decode steps' seconds
        self.samples: dict[int, int] = {}
        self._first: dict[int, list[float]] = {}  # a length's first MIN_SAMPLES times, whose median starts its average
        self.scale = 1.0  # measured extra cost over the prior's
        self.num_timed = 0  # lone steps timed so far
        self.last_timed: dict[int, int] = {}  # draft length -> num_timed at its latest step
        self._timing: tuple[str, int, float] | None = None  # (request id, draft length, planned at)

    def __call__(self, k: int) -> float:
        if self._measured(k) and self._measured(0):
            return self.seconds[k] / self.seconds[0]
        return 1.0 + self.scale * (prior_cost(k) - 1.0)

    def _measured(self, k: int) -> bool:
        return self.samples.get(k, 0) >= MIN_SAMPLES and self.num_timed - self.last_timed[k] <= STALE_STEPS

    def step_planned(self, scheduled: list[ScheduledRequest]) -> None:
        """A step was planned: it ends the timing of the previous one if the same lone request continues, and
        starts its own if it is a lone decode."""
        now = self.clock()
        timing, self._timing = self._timing, None
        if len(scheduled) != 1:
            return
        step = scheduled[0]
        if timing is not None and timing[0] == step.request_id:
            self._observe(timing[1], now - timing[2])
        if step.num_tokens == 1 + len(step.spec_token_ids):
            self._timing = (step.request_id, len(step.spec_token_ids), now)

    def _observe(self, k: int, seconds: float) -> None:
        if k in self.last_timed and self.num_timed - self.last_timed[k] > STALE_STEPS:
            self.seconds.pop(k, None)  # stale: measured afresh
            self.samples[k] = 0
            self._first.pop(k, None)
        estimate = self.seconds.get(k)
        if estimate is not None and seconds > OUTLIER * estimate:
            return
        self.samples[k] = self.samples.get(k, 0) + 1
        self.num_timed += 1
        self.last_timed[k] = self.num_timed
        if estimate is None:
            # The median of the first few: one slow first step (kernels built on first use) does not set the average
            # a length that is then never chosen again would keep.
            first = self._first.setdefault(k, [])
            first.append(seconds)
            if len(first) < MIN_SAMPLES:
                return
            seconds = sorted(first)[len(first) // 2]
            del self._first[k]
        self.seconds[k] = seconds if estimate is None else estimate + EMA_WEIGHT * (seconds - estimate)
        if not self._measured(0):
            return
        ratios = [(self.seconds[j] / self.seconds[0] - 1.0) / (prior_cost(j) - 1.0)
                  for j in self.seconds if j > 0 and self._measured(j)]
        if ratios:
            self.scale = max(0.0, sum(ratios) / len(ratios))
