"""The verify cost measured online: lone decode steps timed from one planning to the next, scaled against the
prior; other steps and idle gaps ignored. Times come from a fake clock (no timing in tests)."""
from __future__ import annotations

import pytest

from pagellm.config import SpeculativeConfig
from pagellm.core.sched.output import ScheduledRequest
from pagellm.spec_decode.adaptive import AdaptiveDrafter
from pagellm.spec_decode.step_cost import MIN_SAMPLES, STALE_STEPS, VerifyCosts, prior_cost


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def decode(request_id: str = "a", k: int = 0, num_computed: int = 100) -> ScheduledRequest:
    return ScheduledRequest(request_id, 1 + k, num_computed, spec_token_ids=[7] * k)


def run_steps(costs: VerifyCosts, clock: Clock, steps: list[tuple[int, float]]) -> None:
    """Lone decode steps of one request: (draft length, seconds) each."""
    for k, seconds in steps:
        costs.step_planned([decode(k=k)])
        clock.now += seconds
    costs.step_planned([decode()])  # the next step's planning ends the last one


def test_prior_until_plain_and_verify_steps_are_measured():
    clock = Clock()
    costs = VerifyCosts(clock)
    run_steps(costs, clock, [(2, 0.02)] * 10)  # verify steps only: nothing to compare them with
    assert costs(2) == pytest.approx(prior_cost(2))


@pytest.mark.parametrize("ratio", [1.2, 3.0])
def test_measured_ratio_scales_the_prior(ratio):
    clock = Clock()
    costs = VerifyCosts(clock)
    run_steps(costs, clock, [(0, 0.01), (2, 0.01 * ratio)] * (MIN_SAMPLES + 2))
    assert costs(2) == pytest.approx(ratio)
    scale = (ratio - 1) / (prior_cost(2) - 1)
    assert costs(4) == pytest.approx(1 + scale * (prior_cost(4) - 1))


def test_each_measured_length_costs_its_own_ratio():
    clock = Clock()
    costs = VerifyCosts(clock)
    run_steps(costs, clock, [(0, 0.01), (1, 0.012), (3, 0.02)] * (MIN_SAMPLES + 2))
    assert costs(1) == pytest.approx(1.2) and costs(3) == pytest.approx(2.0)
    scale = ((1.2 - 1) / (prior_cost(1) - 1) + (2.0 - 1) / (prior_cost(3) - 1)) / 2
    assert costs(2) == pytest.approx(1 + scale * (prior_cost(2) - 1))


def test_a_slow_first_step_does_not_set_the_average():
    clock = Clock()
    costs = VerifyCosts(clock)
    run_steps(costs, clock, [(0, 0.5), (2, 0.02), (0, 0.01), (2, 0.02), (0, 0.01), (2, 0.02)])
    assert costs(2) == pytest.approx(2.0)


def test_batches_idle_gaps_and_prefills_are_not_step_times():
    clock = Clock()
    costs = VerifyCosts(clock)
    run_steps(costs, clock, [(0, 0.01), (1, 0.015)] * MIN_SAMPLES)
    before = dict(costs.seconds)
    costs.step_planned([decode("a"), decode("b")])  # two sequences: not timed, and it ends no lone step
    clock.now += 5.0
    costs.step_planned([decode("a", k=1)])
    clock.now += 5.0  # the engine idled after the request
    costs.step_planned([decode("c")])  # another request: the gap is not a's step
    clock.now += 0.01
    costs.step_planned([ScheduledRequest("c", 30, 0)])  # c's next step is a prefill chunk: c's decode is timed
    clock.now += 1.0
    costs.step_planned([decode("c")])  # the prefill chunk was not timed
    assert costs.seconds[1] == before[1]
    assert costs.samples[0] == MIN_SAMPLES + 1 and costs.seconds[0] == pytest.approx(before[0])


def test_expensive_verify_steps_switch_drafting_off():
    """Drafts that are all kept still do not pay where a verify step costs as much as the tokens it may emit."""
    clock = Clock()
    costs = VerifyCosts(clock)
    run_steps(costs, clock, [(0, 0.01), (1, 0.01 * 2.2), (2, 0.01 * 3.4)] * (MIN_SAMPLES + 3))
    drafter = AdaptiveDrafter(SpeculativeConfig(num_speculative_tokens=4), costs)

    class Request:
        all_token_ids = [5, 6, 7, 8] * 5
        structured_output_request = None

    request, lengths = Request(), []
    for _ in range(30):
        draft = drafter.propose(request, room=100)
        lengths.append(len(draft))
        if draft:
            drafter.observe(request, len(draft), len(draft))
    assert max(lengths) == 1 and sum(lengths) <= 4, "one-token probes only, further and further apart"


def test_a_length_not_timed_for_long_is_measured_afresh():
    """k = 3 timed in a slow spell (5x a plain step) and then never drafted: after STALE_STEPS lone steps it costs
    the prior again (scaled by what was measured since), and its next steps set its cost anew."""
    clock = Clock()
    costs = VerifyCosts(clock)
    run_steps(costs, clock, [(0, 0.01), (1, 0.012), (3, 0.05)] * (MIN_SAMPLES + 2))
    assert costs(3) == pytest.approx(5.0)
    clock.now += 0.01  # the plain step run_steps left planned
    run_steps(costs, clock, [(0, 0.01), (1, 0.012)] * (STALE_STEPS // 2 + 1))
    scale = (1.2 - 1) / (prior_cost(1) - 1)
    assert costs(3) == pytest.approx(1 + scale * (prior_cost(3) - 1))
    clock.now += 0.01
    run_steps(costs, clock, [(0, 0.01), (3, 0.02)] * MIN_SAMPLES)
    assert costs(3) == pytest.approx(2.0)
