"""Background work's share of a step (priority policy): requests of priority `background_priority` or lower (the
lines of /v1/batches jobs) run in what interactive traffic leaves. A request that arrives waits for the step in
flight, whatever it holds, so what matters to interactive latency is how long each step with background work
takes; the online model of a step's time (step_time.py) sets that. By what interactive requests do:

- One waits: background work takes nothing this step (its running rows sit it out, keeping their blocks), so the
  newcomer's prefill runs alone.
- Some run, none waits: background rows ride along only as far as the model predicts they add at most RIDE_SHARE
  to the step's time (on a GPU a decode row beside others costs little; on a CPU one usually does not fit, and
  background work waits for a gap), and at most half as many as interactive ones. Interactive traffic that never
  pauses leaves the batch waiting.
- None runs or waits, but one did within IDLE_WINDOW_S: background steps are short, predicted to take at most
  1 + GAP_EXTRA times a step of one row, so that a request arriving meanwhile waits little. Up to GAP_PROMPT_SHARE
  of that room goes to prompt chunks, the rest to decode rows; at least one row and MIN_PROMPT_TOKENS prompt tokens
  run, so the batch always moves. One such step in PROBE_EVERY takes a row more: steps that all have one row cannot
  tell the model a step's fixed cost from a row's (it then charges it all per row, and would never allow two).
- None for IDLE_WINDOW_S: full speed (max_num_seqs), with prompt chunks of at most IDLE_PROMPT_TOKENS: the first
  interactive request after such a quiet spell waits for one such step, and a 2,048-token chunk made that about
  2 s on a 2-core CPU, while prefill per token is hardly cheaper in chunks larger than a few hundred tokens.

Within the window background work never takes more than MAX_ROWS rows and MAX_PROMPT_TOKENS prompt tokens a
step, whatever the model says (a fit thrown by a stalled step of a shared host once gave it 64 rows); until the
model has seen enough steps, those caps alone stand in (and beside interactive rows, half as many as theirs).
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

from pagellm.core.request import Request
from pagellm.core.sched.step_time import StepShape, StepTimeModel

IDLE_WINDOW_S = 30.0  # interactive traffic seen this recently keeps background steps short
GAP_EXTRA = 0.25  # in a gap of interactive traffic, a background step's time over that of a one-row step, at most
GAP_PROMPT_SHARE = 0.5  # of that extra room, kept for prompt chunks while background prompts wait
RIDE_SHARE = 0.05  # what background rows may add to the time of an interactive step, at most
MIN_PROMPT_TOKENS = 2  # prompt tokens a background step may always take (in a gap)
PROBE_EVERY = 16  # gap steps per step with a row more than the model allows
MAX_ROWS = 8  # background rows a step, at most, within the window
MAX_PROMPT_TOKENS = 16  # background prompt tokens a step, at most, within the window
IDLE_PROMPT_TOKENS = 256  # background prompt tokens a step, at most, after the window

Row = tuple[Request, int]  # a running request and the tokens it could compute this step


class BackgroundShare:
    def __init__(self, priority: int, model: StepTimeModel, max_rows: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`priority`: requests of this priority or lower are background; `max_rows`: max_num_seqs; `clock`: seconds,
        for the idle window (tests pass their own)."""
        self.priority = priority
        self.model = model
        self.max_rows = max_rows
        self.clock = clock
        self.last_interactive = -math.inf  # when an interactive request last ran or waited
        self.num_gap_steps = 0

    def is_background(self, request: Request) -> bool:
        return request.priority >= self.priority

    def budget(self, foreground: list[Row], background: list[Row], waiting: list[Request]) -> tuple[int, int]:
        """(rows, prompt tokens) background requests may take this step: `foreground` and `background` are the
        running requests with work, in running order; `waiting` the waiting queue. Rows count admissions too."""
        interactive_waits = any(not self.is_background(r) for r in waiting)
        now = self.clock()
        if foreground or interactive_waits:
            self.last_interactive = now
        if interactive_waits:
            return 0, 0
        if now - self.last_interactive >= IDLE_WINDOW_S:
            return sys.maxsize, IDLE_PROMPT_TOKENS
        rows = min(MAX_ROWS, max(1, len(foreground) // 2)) if foreground else MAX_ROWS
        if not self.model.ready:
            return rows, MAX_PROMPT_TOKENS
        num_waiting = min(sum(1 for r in waiting if self.is_background(r)), self.max_rows)
        model_rows, model_tokens = self._within_model(foreground, background, num_waiting)
        if not foreground:
            self.num_gap_steps += 1
            if self.num_gap_steps % PROBE_EVERY == 0:
                model_rows += 1
        return min(rows, model_rows), min(MAX_PROMPT_TOKENS, model_tokens)

    def _within_model(self, foreground: list[Row], background: list[Row], num_waiting: int) -> tuple[int, int]:
        """(rows, prompt tokens) for background work within the step time the model predicts: RIDE_SHARE over the
        interactive rows' step, or in a gap 1 + GAP_EXTRA times a one-row step."""
        model = self.model
        assert model.coef is not None
        token_cost = float(model.coef[3])
        fg_contexts = [request.num_computed_tokens + num_new for request, num_new in foreground]
        fg_extra = sum(num_new - 1 for _, num_new in foreground)
        # Each background row at its decode cost (context + 1); prompt chunks are counted as extra tokens. A
        # request admitted this step counts as a row of context 1.
        bg_contexts = [request.num_computed_tokens + 1 for request, _ in background] + [1] * num_waiting
        base = StepShape(len(foreground), sum(fg_contexts), fg_extra)
        if foreground:
            target_s = (1 + RIDE_SHARE) * model.predict(base)
            reserve = 0
        else:
            target_s = (1 + GAP_EXTRA) * model.predict(StepShape(1, bg_contexts[0] if bg_contexts else 1, 0))
            prompts_wait = num_waiting > 0 or any(num_new > 1 for _, num_new in background)
            room = target_s - model.predict(base)
            reserve = int(GAP_PROMPT_SHARE * room / token_cost) if prompts_wait and token_cost > 0 else 0
        rows = model.rows_within(target_s, fg_contexts + bg_contexts, fg_extra + reserve) - len(foreground)
        rows = max(rows, 0 if foreground else 1)
        shape = StepShape(len(foreground) + rows, sum(fg_contexts) + sum(bg_contexts[:rows]), fg_extra)
        tokens = model.max_extra_tokens(target_s, shape)
        return rows, tokens if foreground else max(tokens, MIN_PROMPT_TOKENS)
