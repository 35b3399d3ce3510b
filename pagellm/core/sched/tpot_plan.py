"""Admission against a latency target (`--target-tpot-ms`): which waiting requests start, planned a wave at a time.

A request's TPOT is the mean gap between its tokens, (last token - first token) / (output tokens - 1), so one long
step costs it nothing while its other steps are shorter than the target by as much. And a step's time is far from
linear in its tokens: prompt tokens in a sliver beside the decodes cost up to twice what they cost in a full chunk,
and a decode batch's time rises in stairs (step_time.py). So there is no per-step rule: a group of waiting requests
starts at once, its prompts run in full chunks and end together in the wave's last step (step_limits.py holds each a
token short until then: a first token that came earlier would wait on the others' chunks), and it starts only if,
with it, every request's budget holds:

- a decoding request: the time since its first token, then the wave's steps (each gives it a token) and its decode
  steps at the new batch's predicted time, within the target times its gaps, at every length at which it may end
  (one that stops early has fewer gaps to spread a long step over);
- the new decode batch: predicted within the target (the wave's own requests wait on nothing else).

Of the groups that hold (in the policy's order), the largest whose decode batch, and the rest of the queue's as one
batch after it, give about the most tokens a second starts; no other starts until its prompts are in. A request's
length is sure up to min_tokens, and up to max_tokens (or max_model_len) when nothing else can stop it (ignore_eos,
no stop tokens or strings, no grammar); past what is sure it may end anywhere from the LENGTH_QUANTILE of recently
finished requests' lengths on (the next token, before any finished), so that only slack it will have is spent.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.queues import num_sequences
from pagellm.core.sched.step_time import StepShape, StepTimeModel

LENGTH_WINDOW = 64  # finished requests whose output lengths are kept
LENGTH_QUANTILE = 0.1  # of those lengths: the earliest a request whose length is not sure is expected to end
RATE_TOLERANCE = 0.05  # a larger group starts if its decode batch is this close to the fastest one's tokens a second


@dataclass(slots=True)
class Budget:
    """One request's standing against the target: it may end after `first_end` to `last_end` more tokens."""
    banked: float  # the target times its gaps so far, less the time since its first token
    first_end: int
    last_end: int
    context_end: int  # the positions it attends over at `first_end`


class TpotPlanner:
    def __init__(self, target_s: float, model: StepTimeModel, token_budget: int, max_model_len: int) -> None:
        self.target_s = target_s
        self.model = model
        self.token_budget = token_budget  # max_num_batched_tokens: the prompt chunk of a step
        self.max_model_len = max_model_len
        self.clock = 0.0  # seconds of the steps observed
        self._first_token_at: dict[str, tuple[Request, float]] = {}
        self._lengths: deque[int] = deque(maxlen=LENGTH_WINDOW)

    def observe(self, seconds: float) -> None:
        self.clock += seconds

    def admit(self, decoding: list[Request], waiting: list[Request], free_slots: int) -> int:
        """How many of `waiting` (in order) start now, beside the `decoding` requests (all the running ones, each
        past its first token, tracked), within `free_slots` sequence slots."""
        typical = int(np.quantile(self._lengths, LENGTH_QUANTILE)) if self._lengths else 0
        budgets = [self._budget(request, request.num_output_tokens, typical) for request in decoding]
        candidates, seqs, slots = [], [], 0
        for request in waiting:
            seq = num_sequences(request)
            if slots + seq > free_slots:
                break
            slots += seq
            candidates.append(request)
            seqs.append(seq)
        # Where each would end if it started now (its budget runs from its first token).
        contexts = [self._budget(request, 1, typical).context_end for request in candidates]
        fits = lambda n: self._holds(decoding, budgets, candidates[:n], contexts[:n], seqs[:n])  # noqa: E731
        low, high = (1 if not decoding else 0), len(candidates)  # a request alone always starts
        while low < high:  # the largest group that holds; a larger group never holds where a smaller one fails
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        return self._fastest(decoding, budgets, contexts, seqs, low)

    def _fastest(self, decoding: list[Request], budgets: list[Budget], contexts: list[int], seqs: list[int],
                 most: int) -> int:
        """How many of the `most` first candidates start: the most whose decode batch, and the rest of the
        candidates' as one batch after it, give within RATE_TOLERANCE of the most tokens a second. One request more
        can take a batch up a stair and slow every other one; a large wave can leave a small one behind it."""
        def batch_time(rows: int, context: int) -> float:
            return self.model.decode_time(rows, context) if rows else 0.0

        rows, context = len(decoding), sum(budget.context_end for budget in budgets)
        rest_rows, rest_context = sum(seqs), sum(contexts)
        rates = []
        for n in range(most + 1):
            if n:
                rows, context = rows + seqs[n - 1], context + contexts[n - 1]
                rest_rows, rest_context = rest_rows - seqs[n - 1], rest_context - contexts[n - 1]
            rates.append((rows + rest_rows) / (batch_time(rows, context) + batch_time(rest_rows, rest_context)))
        fastest = max(rates)
        return max(n for n, rate in enumerate(rates) if rate >= (1 - RATE_TOLERANCE) * fastest)

    def _holds(self, decoding: list[Request], budgets: list[Budget], group: list[Request], contexts: list[int],
               seqs: list[int]) -> bool:
        """Whether, with `group` started (its sequences `seqs`, ending at `contexts`), every decoding request holds
        the target and so does the new batch (the group's own first tokens all come in the wave's last step, so its
        decodes are all they wait on)."""
        rows = len(decoding) + sum(seqs)
        decode_s = self.model.decode_time(rows, sum(budget.context_end for budget in budgets) + sum(contexts))
        if decode_s > self.target_s:
            return False
        steps = self._wave_steps(decoding, group)
        return all(self._within(budget, steps, decode_s) for budget in budgets)

    def _within(self, budget: Budget, gaps: list[float], decode_s: float) -> bool:
        """Whether the request holds the target at each length it may end at, its next gaps `gaps` and then
        decode steps of `decode_s` (within the target, so past the gaps the shortest length decides)."""
        target, elapsed = self.target_s, 0.0
        for j, gap in enumerate(gaps, 1):
            if j > budget.last_end:
                return True
            elapsed += gap
            if j >= budget.first_end and budget.banked + target * j < elapsed:
                return False
        j = min(max(budget.first_end, len(gaps) + 1), budget.last_end)
        return j <= len(gaps) or budget.banked + target * j >= elapsed + (j - len(gaps)) * decode_s

    def _wave_steps(self, decoding: list[Request], group: list[Request]) -> list[float]:
        """The predicted seconds of the steps that take the group's prompts in full chunks beside the decodes: each
        prompt a token short of its end, in order, then the last tokens of all in the last step (step_limits.py
        holds them so: every first token of the wave comes in its last step)."""
        rows, context = len(decoding), sum(request.num_tokens for request in decoding)
        room = max(self.token_budget - rows, len(group))
        pending = [max(request.num_tokens - request.num_computed_tokens - 1, 0) for request in group]
        steps: list[StepShape] = []
        i = parts = tokens = 0
        while i < len(pending):
            take = min(pending[i], room - tokens)
            if take:
                parts, tokens = parts + 1, tokens + take
            pending[i] -= take
            if pending[i] == 0:
                i += 1
            if tokens == room:
                steps.append(StepShape(rows + parts, context + tokens, tokens - parts))
                parts = tokens = 0
        if tokens + len(group) > room:  # the last tokens do not fit beside the rest
            steps.append(StepShape(rows + parts, context + tokens, tokens - parts))
            parts = tokens = 0
        steps.append(StepShape(rows + len(group), context + tokens + len(group), tokens))
        return [self.model.step_time(shape) for shape in steps]

    def _budget(self, request: Request, num_output_tokens: int, typical: int) -> Budget:
        """`num_output_tokens`: those it has (1 for a request that starts now: its budget from its first token);
        `typical`: the length a request whose length is not sure is expected to reach at least."""
        params = request.sampling_params
        last_end = max(min(request.max_tokens - num_output_tokens, self.max_model_len - request.num_tokens), 1)
        sure_to_max = params.ignore_eos and not params.stop and not params.stop_token_ids and (
            request.structured_output_request is None)
        if sure_to_max:
            first_end = last_end
        else:
            first_end = min(max(params.min_tokens, typical) - num_output_tokens, last_end)
        first_end = max(first_end, 1)
        started = self._first_token_at.get(request.request_id)
        banked = self.target_s * (num_output_tokens - 1) - (self.clock - started[1] if started else 0.0)
        return Budget(banked, first_end, last_end, request.num_tokens + first_end)

    def track(self, running: list[Request]) -> None:
        """Before each step: note when each running request's first token came (this step's start, for one seen
        with its first token now); drop the finished ones, keeping their lengths. A preempted request keeps its
        time: its gaps go on counting."""
        for request_id, (request, _) in list(self._first_token_at.items()):
            if request.status.is_finished:
                del self._first_token_at[request_id]
                if request.status != RequestStatus.FINISHED_ABORTED:
                    self._lengths.append(request.num_output_tokens)
        for request in running:
            if request.num_output_tokens:
                self._first_token_at.setdefault(request.request_id, (request, self.clock))
