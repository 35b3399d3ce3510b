"""An online model of a step's time from its shape, for `--target-tpot-ms`.

    step seconds ~= a + b * rows + c * context + d * extra_tokens

`rows`: sequences in the step; `context`: the positions they attend over (computed + new, summed over rows);
`extra_tokens`: tokens beyond one per row (prompt chunks, draft tokens). The engine measures each step and hands
the time down (`Scheduler.observe_step_time`); the coefficients are a non-negative least-squares fit over the recent
steps (a step never gets cheaper with more work), each step weighed by its relative error. Steps with and without
extra tokens are kept apart, so a long run of decodes does not push the prefill cost out of the window.

A fit from steps that all had the same number of rows cannot tell the fixed cost `a` from the per-row cost `b`;
the non-negative fit then charges it all per row, so a cap computed from it errs small (charging it to `a` made the
cap overshoot, and the requests a corrected cap then deferred missed the target). The steps of another size that
such a cap gives tell the two apart at the next fits; an engine's first steps are not observed (lazy
initialisation makes them slow, and one made prompt tokens look 4x their cost).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from pagellm.core.sched.output import SchedulerOutput

WINDOW = 128  # recent steps kept, per kind (with and without extra tokens)
MIN_STEPS = 8  # steps observed before the model is trusted
COLD_STEPS = 2  # an engine's first steps, not observed (lazy initialisation makes them slow)
OUTLIER_FACTOR = 4.0  # steps whose time the first fit misses by more than this times the median miss are dropped
# A fit costs ~0.1 ms, 2-3% of a batch-1 decode step: once the model predicts a step within WELL_PREDICTED of its
# time, it is refitted every REFIT_EVERY steps only (a step it misses still refits at once).
WELL_PREDICTED = 0.1
REFIT_EVERY = 16


@dataclass(frozen=True)
class StepShape:
    rows: int
    context: int
    extra_tokens: int

    @classmethod
    def of(cls, output: SchedulerOutput) -> StepShape:
        scheduled = output.scheduled
        return cls(len(scheduled), sum(s.num_computed_tokens + s.num_tokens for s in scheduled),
                   sum(s.num_tokens - 1 for s in scheduled))

    def features(self) -> tuple[float, float, float, float]:
        return 1.0, float(self.rows), float(self.context), float(self.extra_tokens)


class StepTimeModel:
    def __init__(self) -> None:
        self._decode_steps: deque[tuple[StepShape, float]] = deque(maxlen=WINDOW)
        self._mixed_steps: deque[tuple[StepShape, float]] = deque(maxlen=WINDOW)
        self.coef: np.ndarray | None = None  # (a, b, c, d), seconds; None until MIN_STEPS steps were seen
        self._cold_steps_left = COLD_STEPS
        self._steps_since_fit = 0

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape.rows == 0 or seconds <= 0:
            return
        if self._cold_steps_left:
            self._cold_steps_left -= 1
            return
        (self._mixed_steps if shape.extra_tokens else self._decode_steps).append((shape, seconds))
        if len(self._decode_steps) + len(self._mixed_steps) < MIN_STEPS:
            return
        self._steps_since_fit += 1
        if (self.coef is None or self._steps_since_fit >= REFIT_EVERY
                or abs(self.predict(shape) - seconds) > WELL_PREDICTED * seconds):
            self.fit()

    def fit(self) -> None:
        self._steps_since_fit = 0
        steps = [*self._decode_steps, *self._mixed_steps]
        x = np.array([shape.features() for shape, _ in steps])
        y = np.array([seconds for _, seconds in steps])
        # The solver takes the rows column first (ahead of the constant, so that steps of one size charge their
        # time per row and the cap errs small), the large columns scaled to comparable sizes.
        order = [1, 0, 2, 3]
        scale = np.array([1.0, 1.0, *np.maximum(x[:, 2:].max(axis=0), 1.0)])
        # Each step weighs by its relative error (its equation divided by its time): in seconds, a few long prompt
        # steps outweighed the many decode steps whose time the cap turns on (a loaded host's fit put a 13 ms decode
        # at 40 ms, and the cap at one row).
        x = x[:, order] / scale / y[:, None]
        ones = np.ones_like(y)
        coef, _ = nnls(x, ones)
        # Once more without the steps the fit misses by far (a stall of a shared host).
        residual = np.abs(x @ coef - ones)
        kept = residual <= OUTLIER_FACTOR * np.median(residual) + 1e-3
        if kept.sum() >= MIN_STEPS and not kept.all():
            coef, _ = nnls(x[kept], ones[kept])
        self.coef = (coef / scale)[np.argsort(order)]

    def predict(self, shape: StepShape) -> float:
        assert self.coef is not None
        return float(np.dot(self.coef, shape.features()))

    def rows_within(self, target_s: float, contexts: list[int], extra_tokens: int = 0) -> int:
        """How many of these rows (their contexts, in order) fit a step predicted to take at most `target_s`, with
        `extra_tokens` beside them (0 when not even one fits)."""
        a, b, c, d = self.coef
        room = target_s - a - d * extra_tokens
        for rows, context in enumerate(contexts):
            room -= b + c * context
            if room < 0:
                return rows
        return len(contexts)

    def extra_tokens_within(self, share: float, target_s: float, at_least: int) -> int:
        """Extra tokens that take this `share` of a step's time beyond its fixed cost, and `at_least` (so that the
        cost of prompt tokens keeps being measured, even when it is overestimated); 0 while the model has seen
        none."""
        a, d = self.coef[0], self.coef[3]
        return max(at_least, int(share * (target_s - a) / d)) if d > 0 else 0

    def max_extra_tokens(self, target_s: float, shape: StepShape) -> int:
        """The most extra tokens (prompt chunk tokens) a step of this shape can add within `target_s`."""
        d = self.coef[3]
        room = target_s - self.predict(shape)
        if d <= 0:
            return 1 << 30 if room >= 0 else 0
        return max(0, int(room // d))
