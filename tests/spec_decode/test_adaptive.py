"""The adaptive draft length: a request's drafts follow its acceptance, stop when they do not pay, and come back
through probes whose spacing doubles while they fail; with async scheduling a request that drafts asks for a draft
every step, one whose drafting is off runs blind (its waits still counting) and probes again."""
from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

import pytest
from scheduler_factories import make_request

from pagellm.config import SpeculativeConfig
from pagellm.spec_decode import adaptive
from pagellm.spec_decode.adaptive import AdaptiveDrafter, best_length, expected_tokens
from pagellm.spec_decode.step_cost import prior_cost
from pagellm.spec_decode.suffix_proposer import SuffixDraft, SuffixProposer


@dataclass(eq=False)
class FakeRequest:
    # A sequence that always repeats: prompt lookup always finds a draft.
    all_token_ids: list[int] = field(default_factory=lambda: [5, 6, 7, 8, 9] * 6)
    structured_output_request: None = None


def drafter(k: int = 4) -> AdaptiveDrafter:
    return AdaptiveDrafter(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3))


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.8, 1.0])
def test_expected_tokens_is_the_geometric_sum(rate):
    # Position i is reached (and its draft kept) with probability rate^i; the step emits kept drafts + 1.
    for k in range(1, 6):
        assert expected_tokens(rate, k) == pytest.approx(sum(rate ** i for i in range(k + 1)))


def test_best_length_pays_against_a_plain_step():
    assert best_length(0.0, 4) == 0
    assert best_length(1.0, 4) >= 1
    for rate in (0.2, 0.5, 0.7, 0.9, 1.0):
        k = best_length(rate, 4)
        if k:
            assert expected_tokens(rate, k) > prior_cost(k)
        else:
            assert all(expected_tokens(rate, j) <= prior_cost(j) for j in range(1, 5))


def run(d: AdaptiveDrafter, request: FakeRequest, steps: int, accept) -> list[int]:
    """`steps` decode steps; `accept(step, draft)` says how many of the draft the target keeps. Returns each step's
    draft length."""
    lengths = []
    for step in range(steps):
        draft = d.propose(request, room=100)
        lengths.append(len(draft))
        if draft:
            d.observe(request, len(draft), accept(step, draft))
    return lengths


def test_rejected_drafts_switch_off_then_probes_back_off():
    d, request = drafter(), FakeRequest()
    lengths = run(d, request, 200, lambda step, draft: 0)
    first_off = lengths.index(0)
    assert first_off <= 4, "drafting that never pays stops within a few steps"
    probes = [i for i in range(first_off, 200) if lengths[i]]
    assert all(lengths[i] == 1 for i in probes), "a probe drafts one token"
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [8, 16, 32, 64] and set(gaps[4:]) == {adaptive.MAX_PROBE_WAIT}
    assert sum(lengths[first_off:]) / (200 - first_off) < 0.1  # at most a one-token verify now and then


def test_accepted_drafts_keep_drafting_and_a_good_probe_turns_it_back_on():
    d, request = drafter(), FakeRequest()
    lengths = run(d, request, 20, lambda step, draft: len(draft))
    assert 0 not in lengths and lengths[-1] >= 2 and lengths == sorted(lengths), "drafts lengthen as they pay"
    lengths = run(d, request, 60, lambda step, draft: 0 if step < 20 else len(draft))
    assert 0 in lengths[:30], "it stopped while the drafts failed"
    back = max(i for i, n in enumerate(lengths) if n == 0) + 1
    assert back < 45 and 0 not in lengths[back:] and lengths[-1] >= 2


def test_each_request_has_its_own_length_and_its_state_goes_with_it():
    d, copying, writing = drafter(), FakeRequest(), FakeRequest()
    for _ in range(10):
        for request, kept in ((copying, len), (writing, lambda draft: 0)):
            draft = d.propose(request, room=100)
            if draft:
                d.observe(request, len(draft), kept(draft))
    assert len(d.propose(copying, room=100)) >= 2
    assert d.propose(writing, room=100) == []
    assert d.propose(copying, room=1) and len(d.propose(copying, room=1)) == 1  # never past the room
    del writing, request  # the loop variable held it too
    gc.collect()
    assert len(d.states) == 1


class ScriptedSuffix(SuffixProposer):
    """Suffix drafts whose match length the test sets: `match_len` for the next draft."""

    match_len = 1

    def draft(self, request, max_tokens=None) -> SuffixDraft:
        k = min(self.k, max_tokens or self.k)
        return SuffixDraft(list(range(k)), [1.0] * k, self.match_len)


def test_suffix_drafts_keep_a_rate_per_match_length():
    """Drafts after long matches are all kept and those after one-token matches never: the short ones switch off
    (probing now and then) while the long ones keep drafting long."""
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
    d = AdaptiveDrafter(config)
    d.proposer = ScriptedSuffix(config)
    request = FakeRequest()
    lengths: dict[int, list[int]] = {1: [], 20: []}
    for step in range(80):
        match_len = 20 if step % 2 else 1
        d.proposer.match_len = match_len
        draft = d.propose(request, room=100)
        lengths[match_len].append(len(draft))
        if draft:
            d.observe(request, len(draft), len(draft) if match_len == 20 else 0)
    assert 0 not in lengths[20] and lengths[20][-1] >= 2
    assert sum(lengths[1][20:]) <= 4, "short matches stopped drafting but for a few one-token probes"
    assert d.states[request].classes[adaptive.match_class(1)].rate < 0.2


# ---- async scheduling: may_draft decides between waiting for the batch in flight and a blind step ------------------
def repeating_request():
    """A decoding request (one output token so far) whose tokens always repeat: prompt lookup always drafts."""
    request = make_request("r", prompt=[5, 6, 7, 8, 9] * 6, max_tokens=1000)
    request.append_output_token(5)
    return request


def run_async(d: AdaptiveDrafter, request, steps: int, accept) -> tuple[list[int], list[bool]]:
    """As `run`, the planner's way under async scheduling: a request that may draft proposes (it waits for its batch
    in flight), any other runs blind. Returns each step's draft length and whether it proposed."""
    lengths, asked = [], []
    for step in range(steps):
        asked.append(d.may_draft(request))
        if asked[-1]:
            draft = d.propose(request, room=100)
            if draft:
                d.observe(request, len(draft), accept(step, draft))
        else:
            d.count_blind_step(request)
            draft = []
        lengths.append(len(draft))
    return lengths, asked


def test_async_a_request_whose_drafts_pay_proposes_every_step():
    lengths, asked = run_async(drafter(), repeating_request(), 30, lambda step, draft: len(draft))
    assert all(asked) and 0 not in lengths


def test_async_a_request_whose_drafts_fail_runs_blind_and_still_probes():
    """Prompt lookup's drafts all fail: the request soon runs blind (the async overlap kept) but for about one step
    in nine, and its blind steps count toward the probe waits, so one-token probes keep coming."""
    lengths, asked = run_async(drafter(), repeating_request(), 400, lambda step, draft: 0)
    probes = [i for i in range(100, 400) if lengths[i]]
    assert probes and all(lengths[i] == 1 for i in probes)
    # A proposal after every MAX_QUIET_WAIT blind steps, and one more after each probe.
    assert sum(asked[100:]) <= 300 / (adaptive.MAX_QUIET_WAIT + 1) + len(probes) + 1
    assert all(b - a <= adaptive.MAX_PROBE_WAIT + adaptive.MAX_QUIET_WAIT + 1 for a, b in zip(probes, probes[1:]))


def test_async_a_draft_model_that_is_off_probes_when_it_would_without_async_scheduling():
    """A draft model's drafts are one class: once off, the request may not draft (it runs blind) until the wait is
    over, and its probes come at the very steps they come without async scheduling."""
    config = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3)
    sync_lengths = run(AdaptiveDrafter(config), repeating_request(), 150, lambda step, draft: 0)
    lengths, asked = run_async(AdaptiveDrafter(config), repeating_request(), 150, lambda step, draft: 0)
    assert lengths == sync_lengths
    assert asked == [n > 0 for n in lengths], "it proposes exactly at its drafts and probes, else runs blind"


def test_async_a_request_with_no_draft_to_find_asks_less_and_less_often():
    """Text that does not repeat: each empty proposal doubles the blind steps before the next one, up to
    MAX_QUIET_WAIT; a request that may not speculate at all (penalties) never waits for a draft."""
    request = make_request("r", prompt=[1, 2, 3, 4], max_tokens=1000)
    request.append_output_token(9)
    _, asked = run_async(drafter(), request, 40, lambda step, draft: 0)
    proposals = [i for i, a in enumerate(asked) if a]
    gaps = [b - a - 1 for a, b in zip(proposals, proposals[1:])]
    assert gaps[:4] == [1, 2, 4, 8] and set(gaps[4:]) == {adaptive.MAX_QUIET_WAIT}
    penalized = repeating_request()
    penalized.sampling_params = dataclasses.replace(penalized.sampling_params, repetition_penalty=1.2)
    assert not drafter().may_draft(penalized)
