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

With async scheduling (core/sched/async_scheduling.py) a decode may run blind, planned before the token its batch in
flight samples is known, and then drafts nothing (a draft needs the request's tokens). So the planner asks
`may_draft` first: a request that may draft waits for its batch instead. It may unless every class is off until its
probe, or its recent proposals found no draft: each empty proposal lets it run blind for `next_quiet` decode steps
(1, doubling while proposals stay empty, up to `MAX_QUIET_WAIT`; a verify step that shows drafts pay resets it), so
text that does not repeat keeps the overlap in eight steps of nine, and copying that starts again is drafted within
nine steps. Waits count decode steps, blind ones too (`count_blind_step`), so a request that is off probes after as
many steps as without async scheduling (or at its next proposal, if it is quiet then).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.config import SpeculativeConfig
from pagellm.core.request import Request
from pagellm.core.sched.output import ScheduledRequest
from pagellm.spec_decode.draft_model import DraftModelSlots
from pagellm.spec_decode.eligibility import may_speculate
from pagellm.spec_decode.ngram_proposer import NgramProposer
from pagellm.spec_decode.step_cost import VerifyCosts, prior_cost
from pagellm.spec_decode.suffix_proposer import SuffixProposer

DECAY = 0.75
PRIOR_ACCEPTED, PRIOR_TRIALS = 3.0, 3.75  # a new request starts at r = 0.8, worth about three verify steps
PROBE_WAIT, MAX_PROBE_WAIT = 4, 64
MAX_QUIET_WAIT = 8  # async scheduling: the most blind steps between proposals after empty ones
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
    quiet: int = 0  # decode steps left that may run blind (async scheduling) after proposals without a draft
    next_quiet: int = 1


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

    def may_draft(self, request: Request) -> bool:
        """Whether the request's next decode should propose a draft (async scheduling: or else it may run blind).
        Asks nothing of the proposer: a few comparisons."""
        if not may_speculate(request):
            return False
        drafts = self.states.get(request)
        return drafts is None or (drafts.quiet == 0 and any(state.wait == 0 for state in drafts.classes))

    def count_blind_step(self, request: Request) -> None:
        """Async scheduling: the request decodes a step blind, with no draft; its waits count it."""
        self._count_step(self._request(request))

    @staticmethod
    def _count_step(drafts: RequestDrafts) -> None:
        for state in drafts.classes:
            state.wait = max(state.wait - 1, 0)
        drafts.quiet = max(drafts.quiet - 1, 0)

    def propose(self, request: Request, room: int) -> list[int]:
        """Draft tokens for the request's next step, at most `room`; under a grammar only the prefix it allows."""
        drafts = self._request(request)
        draft = self._propose(request, drafts, room)
        if not draft:
            drafts.quiet, drafts.next_quiet = drafts.next_quiet, min(2 * drafts.next_quiet, MAX_QUIET_WAIT)
        return draft

    def _propose(self, request: Request, drafts: RequestDrafts, room: int) -> list[int]:
        waiting = [state.wait > 0 for state in drafts.classes]
        self._count_step(drafts)
        if all(waiting) or room <= 0:
            return []  # every class is off until its probe: no draft to look for
        draft, match_len = self._draft(request, min(self.max_k, room))
        structured = request.structured_output_request
        if draft and structured is not None:  # a grammar: only the prefix it allows can be accepted
            draft = draft[:structured.draft_length(request.output_token_ids, draft)]
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
            drafts.next_quiet = 1
