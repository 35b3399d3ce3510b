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

A request keeps one such rate (and probe wait) per class of draft, by the length of the match it came from
(`MATCH_CLASSES`; prompt lookup's n-gram, 1-4 tokens by default, or suffix decoding's match, up to 24): a draft after
a long match is copied text far more often (on pagellm bench spec's answers the first token after a match of 16 or
more was kept 97% of the time, after one of 1-3 tokens 22-79%), so long matches draft long while short ones stay
short or off. A draft model's drafts are one class.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.config import SpeculativeConfig
from pagellm.core.request import Request
from pagellm.core.sched.output import ScheduledRequest
from pagellm.spec_decode.draft_model import DraftModelSlots
from pagellm.spec_decode.ngram_proposer import NgramProposer
from pagellm.spec_decode.step_cost import VerifyCosts, prior_cost
from pagellm.spec_decode.suffix_proposer import SuffixProposer

DECAY = 0.75
PRIOR_ACCEPTED, PRIOR_TRIALS = 3.0, 3.75  # a new request starts at r = 0.8, worth about three verify steps
PROBE_WAIT, MAX_PROBE_WAIT = 4, 64
MATCH_CLASSES = (2, 4, 8, 16)  # drafts' classes by match length: below 2, 2-3, 4-7, 8-15, 16 and more


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


def match_class(match_len: int) -> int:
    return sum(match_len >= bound for bound in MATCH_CLASSES)


@dataclass
class DraftState:
    accepted: float = PRIOR_ACCEPTED  # decayed sums over the verify steps of the request's drafts of one class
    trials: float = PRIOR_TRIALS
    wait: int = 0  # decode steps left before the next probe, while drafting is off
    next_wait: int = PROBE_WAIT

    @property
    def rate(self) -> float:
        return self.accepted / self.trials


@dataclass
class RequestDrafts:
    classes: list[DraftState]
    verifying: int = 0  # the class of the draft in flight


class AdaptiveDrafter:
    """Drafts for the scheduler (see core/sched/batch.py) with each request's own draft length, and learns from
    each verified draft (see core/sched/results.py). Requests' states live as long as the requests."""

    def __init__(self, config: SpeculativeConfig, costs: VerifyCosts | None = None) -> None:
        self.proposer: SuffixProposer | NgramProposer | DraftModelSlots = (
            SuffixProposer(config) if config.method == "suffix"
            else DraftModelSlots(config) if config.method == "draft_model" else NgramProposer(config))
        self.num_classes = 1 if config.method == "draft_model" else len(MATCH_CLASSES) + 1
        self.max_k = config.num_speculative_tokens
        self.costs = costs or VerifyCosts()
        self.states: weakref.WeakKeyDictionary[Request, RequestDrafts] = weakref.WeakKeyDictionary()

    def _request(self, request: Request) -> RequestDrafts:
        drafts = self.states.get(request)
        if drafts is None:
            drafts = self.states[request] = RequestDrafts([DraftState() for _ in range(self.num_classes)])
        return drafts

    def propose(self, request: Request, room: int) -> list[int]:
        """Draft tokens for the request's next step, at most `room`."""
        drafts = self._request(request)
        waiting = [state.wait > 0 for state in drafts.classes]
        for state in drafts.classes:
            state.wait = max(state.wait - 1, 0)
        if all(waiting) or room <= 0:
            return []  # every class is off until its probe: no draft to look for
        draft, match_len = self._draft(request, min(self.max_k, room))
        if not draft:
            return []
        drafts.verifying = match_class(match_len) if self.num_classes > 1 else 0
        k = best_length(drafts.classes[drafts.verifying].rate, self.max_k, self.costs)
        if k == 0:
            if waiting[drafts.verifying]:
                return []
            k = 1  # the probe
        return draft[:k]

    def _draft(self, request: Request, max_tokens: int) -> tuple[list[int], int]:
        """The proposer's longest draft, and the length of the match it follows (0: not known)."""
        if isinstance(self.proposer, SuffixProposer):
            draft = self.proposer.draft(request, max_tokens)
            return draft.token_ids, draft.match_len
        return self.proposer.draft(request.all_token_ids, max_tokens)

    def step_planned(self, scheduled: list[ScheduledRequest]) -> None:
        """The step just planned (for the verify cost's timing; the suffix cache takes finished requests' outputs)."""
        self.costs.step_planned(scheduled)
        if isinstance(self.proposer, SuffixProposer):
            self.proposer.step_planned()

    def observe(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """A verify step kept `num_accepted` of the request's `num_drafted` draft tokens."""
        drafts = self._request(request)
        state = drafts.classes[drafts.verifying]
        state.accepted = DECAY * state.accepted + num_accepted
        state.trials = DECAY * state.trials + num_accepted + (num_accepted < num_drafted)
        if best_length(state.rate, self.max_k, self.costs) == 0:
            state.wait, state.next_wait = state.next_wait, min(2 * state.next_wait, MAX_PROBE_WAIT)
        else:
            state.next_wait = PROBE_WAIT
