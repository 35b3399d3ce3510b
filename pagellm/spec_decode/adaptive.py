"""Adaptive draft length, per request: how many tokens a request drafts follows how many of its recent drafts the
target accepted, and a request whose drafts do not pay stops drafting, probing again later.

A verify step with k drafts costs `verify_cost(k)` plain decode steps (measured as the engine runs, see
step_cost.py), and with a per-position acceptance rate r it
emits (1 - r^(k+1)) / (1 - r) tokens on average. Each step the request drafts the k in 1..num_speculative_tokens
that emits the most tokens per cost, or nothing when no k beats a plain step (1 token per 1 step). r is the
request's accepted drafts over the positions its drafts put to the test, both decayed by `DECAY` per verify step,
so that it follows a request moving between copying its prompt and writing new text. A request that stopped
drafting waits `PROBE_WAIT` decode steps, then verifies a one-token probe; each probe that leaves it off doubles the
wait (up to `MAX_PROBE_WAIT`), so text that never repeats costs a one-token verify every 64 steps at most.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.config import SpeculativeConfig
from pagellm.core.request import Request
from pagellm.core.sched.output import ScheduledRequest
from pagellm.spec_decode.ngram_proposer import NgramProposer
from pagellm.spec_decode.step_cost import VerifyCosts, prior_cost

DECAY = 0.75
PRIOR_ACCEPTED, PRIOR_TRIALS = 3.0, 3.75  # a new request starts at r = 0.8, worth about three verify steps
PROBE_WAIT, MAX_PROBE_WAIT = 4, 64


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verify step emits on average: the accepted drafts (each kept with probability `rate` while the ones
    before it were) and the token sampled after them."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def best_length(rate: float, max_k: int, verify_cost: Callable[[int], float] = prior_cost) -> int:
    """The draft length that emits the most tokens per unit of cost at acceptance `rate`; 0 when none beats a
    plain decode step."""
    gains = [expected_tokens(rate, k) / verify_cost(k) for k in range(1, max_k + 1)]
    best = max(range(len(gains)), key=gains.__getitem__)
    return best + 1 if gains[best] > 1.0 else 0


@dataclass
class DraftState:
    accepted: float = PRIOR_ACCEPTED  # decayed sums over the request's verify steps
    trials: float = PRIOR_TRIALS
    wait: int = 0  # decode steps left before the next probe, while drafting is off
    next_wait: int = PROBE_WAIT

    @property
    def rate(self) -> float:
        return self.accepted / self.trials


class AdaptiveDrafter:
    """Drafts for the scheduler (see core/sched/batch.py) with each request's own draft length, and learns from
    each verified draft (see core/sched/results.py). Requests' states live as long as the requests."""

    def __init__(self, config: SpeculativeConfig, costs: VerifyCosts | None = None) -> None:
        self.proposer = NgramProposer(config)
        self.max_k = config.num_speculative_tokens
        self.costs = costs or VerifyCosts()
        self.states: weakref.WeakKeyDictionary[Request, DraftState] = weakref.WeakKeyDictionary()

    def propose(self, request: Request, room: int) -> list[int]:
        """Draft tokens for the request's next step, at most `room`."""
        state = self.states.setdefault(request, DraftState())
        k = best_length(state.rate, self.max_k, self.costs)
        if k == 0:
            if state.wait > 0:
                state.wait -= 1
                return []
            k = 1  # the probe
        k = min(k, room)
        return self.proposer.propose(request.all_token_ids, k) if k > 0 else []

    def step_planned(self, scheduled: list[ScheduledRequest]) -> None:
        """The step just planned (for the verify cost's timing)."""
        self.costs.step_planned(scheduled)

    def observe(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """A verify step kept `num_accepted` of the request's `num_drafted` draft tokens."""
        state = self.states.setdefault(request, DraftState())
        state.accepted = DECAY * state.accepted + num_accepted
        state.trials = DECAY * state.trials + num_accepted + (num_accepted < num_drafted)
        if best_length(state.rate, self.max_k, self.costs) == 0:
            state.wait, state.next_wait = state.next_wait, min(2 * state.next_wait, MAX_PROBE_WAIT)
        else:
            state.next_wait = PROBE_WAIT
