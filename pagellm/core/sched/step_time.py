"""An online model of a step's time from its shape, for `--target-tpot-ms`.

    step seconds ~= a + b * rows + c * context + d * extra_tokens

`rows`: sequences in the step; `context`: the positions they attend over (computed + new, summed over rows);
`extra_tokens`: tokens beyond one per row (prompt chunks, draft tokens). The engine measures each step and hands
the time down (`Scheduler.observe_step_time`); the coefficients are a non-negative least-squares fit over the recent
steps (a step never gets cheaper with more work), each step weighed by its relative error. Steps with and without
extra tokens are kept apart, so a long run of decodes does not push the prefill cost out of the window.

A decode batch's time is not linear in its rows, though: it rises in stairs where the kernels change path (on one
2-core host 12 rows took 19 ms, 13 rows 30, 32 rows 41, 33 rows 57), and a line through such stairs misses by up to
half. So decode steps are also kept by their number of rows (`decode_time`): a batch is predicted at the time of
the smallest batch at least as large that was seen (a step never gets cheaper with more rows), and beyond the
largest seen by the fit (or that batch's time per row, if more).

A fit from steps that all had the same number of rows cannot tell the fixed cost `a` from the per-row cost `b`;
the non-negative fit then charges it all per row, so a cap computed from it errs small (charging it to `a` made the
cap overshoot, and the requests a corrected cap then deferred missed the target). The steps of another size that
such a cap gives tell the two apart at the next fits; an engine's first steps are not observed (lazy
initialisation makes them slow, and one made prompt tokens look 4x their cost).
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from pagellm.core.sched.output import SchedulerOutput

WINDOW = 128  # recent steps kept, per kind (with and without extra tokens)
MIN_STEPS = 8  # steps observed before the model is trusted
COLD_STEPS = 2  # an engine's first steps, not observed (lazy initialisation makes them slow)
OUTLIER_FACTOR = 4.0  # steps whose time the first fit misses by more than this times the median miss are dropped
# A fit costs 0.1-0.3 ms, 3-8% of a batch-1 decode step, so the line is refitted every REFIT_EVERY steps only: what
# a plan needs now (decode steps by their rows, prompt tokens' recent cost) is kept step by step beside it.
REFIT_EVERY = 16
BY_ROWS_SAMPLES = 16  # recent decode steps kept per number of rows
TOKEN_COST_SAMPLES = 32  # recent steps with prompt tokens whose cost per token is kept


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
        self._decodes_by_rows: dict[int, deque[tuple[int, float]]] = {}  # rows -> recent (context, seconds)
        self._rows_seen: list[int] = []  # the keys of _decodes_by_rows, sorted
        self._medians: dict[int, tuple[float, float]] = {}  # rows -> median (context, seconds) of those steps
        self._token_costs: deque[float] = deque(maxlen=TOKEN_COST_SAMPLES)  # seconds per prompt token, recent steps
        self._mixed_steps: deque[tuple[StepShape, float]] = deque(maxlen=WINDOW)
        self.coef: np.ndarray | None = None  # (a, b, c, d), seconds; None until MIN_STEPS steps were seen
        self._cold_steps_left = COLD_STEPS
        self._steps_since_fit = 0

    @property
    def ready(self) -> bool:
        return self.coef is not None

    @property
    def rows_seen(self) -> list[int]:
        """The decode batch sizes observed, ascending."""
        return list(self._rows_seen)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape.rows == 0 or seconds <= 0:
            return
        if self._cold_steps_left:
            self._cold_steps_left -= 1
            return
        (self._mixed_steps if shape.extra_tokens else self._decode_steps).append((shape, seconds))
        if shape.extra_tokens and self._rows_seen and self.coef is not None:  # its prompt tokens' cost beyond its rows
            self._token_costs.append((seconds - self.decode_time(shape.rows, shape.context)) / shape.extra_tokens)
        if not shape.extra_tokens:
            if shape.rows not in self._decodes_by_rows:
                self._decodes_by_rows[shape.rows] = deque(maxlen=BY_ROWS_SAMPLES)
                bisect.insort(self._rows_seen, shape.rows)
            steps = self._decodes_by_rows[shape.rows]
            steps.append((shape.context, seconds))
            contexts, times = zip(*steps, strict=True)
            self._medians[shape.rows] = (statistics.median(contexts), statistics.median(times))
        if len(self._decode_steps) + len(self._mixed_steps) < MIN_STEPS:
            return
        self._steps_since_fit += 1
        if self.coef is None or self._steps_since_fit >= REFIT_EVERY:
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

    def decode_time(self, rows: int, context: int) -> float:
        """A decode step of `rows` rows over `context` positions in all: the median time of the recent steps of
        the smallest batch seen that is at least as large, moved by the fit's cost of the context between their
        median context and this one; beyond the largest batch seen, the fit's prediction, or that batch's time per
        row if more."""
        seen = self._rows_seen
        i = bisect.bisect_left(seen, rows)
        if i < len(seen):
            return self._measured(seen[i], context)
        fitted = self.predict(StepShape(rows, context, 0))
        if not seen:
            return fitted
        # A row costs less in a larger batch (what a batch shares, the weights' reads, is spread thinner), so the
        # fit, through smaller batches, errs high beyond them, except across a stair: there the largest batch's time
        # per row bounds it from below.
        top = seen[-1]
        return max(fitted, self._measured(top, context * top // rows) * rows / top)

    def _measured(self, rows: int, context: int) -> float:
        median_context, median_seconds = self._medians[rows]
        c = float(self.coef[2]) if self.coef is not None else 0.0
        return median_seconds + c * (context - median_context)

    def step_time(self, shape: StepShape) -> float:
        """Any step: its rows as a decode step (`decode_time`), and its extra tokens at the median cost per token
        that recent steps with prompt tokens had beyond their rows; before any, at the largest decode batch's cost
        per row (a token costs less in a prompt chunk than as a decode row)."""
        seconds = self.decode_time(shape.rows, shape.context)
        if not shape.extra_tokens:
            return seconds
        if self._token_costs:
            per_token = max(float(np.median(self._token_costs)), 0.0)
        else:
            top = self._rows_seen[-1] if self._rows_seen else 1
            per_token = self.decode_time(top, shape.context * top // max(shape.rows, 1)) / top
        return seconds + per_token * shape.extra_tokens

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

    def max_extra_tokens(self, target_s: float, shape: StepShape) -> int:
        """The most extra tokens (prompt chunk tokens) a step of this shape can add within `target_s`."""
        d = self.coef[3]
        room = target_s - self.predict(shape)
        if d <= 0:
            return 1 << 30 if room >= 0 else 0
        return max(0, int(room // d))
