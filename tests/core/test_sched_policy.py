"""Scheduling policies: priority order and priority preemption, short-first order and its starvation bound, and
sequence slots held for beam search forks."""
from __future__ import annotations

import pytest
from scheduler_factories import TOKEN, make_request, make_scheduler

from pagellm.core.beam_group import BeamGroup
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched import policy as sched_policy
from pagellm.core.sched.scheduler import Scheduler
from pagellm.sampling_params import BeamSearchParams, SamplingParams


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = {s.request_id: [TOKEN] * s.num_samples for s in out.scheduled if s.needs_sample}
    sched.update_from_output(out, sampled)
    return out


def scheduled_ids(out) -> list[str]:
    return [s.request_id for s in out.scheduled]


def test_priority_admits_lowest_value_first_then_by_arrival():
    sched = make_scheduler(scheduling_policy="priority", max_model_len=128, max_num_seqs=2)
    for request_id, priority, arrival in [("late-high", 0, 3.0), ("low", 5, 1.0), ("early-high", 0, 2.0)]:
        sched.add_request(make_request(request_id, max_tokens=4, priority=priority, arrival_time=arrival))
    assert scheduled_ids(step(sched)) == ["early-high", "late-high"]


def test_higher_priority_arrival_preempts_the_lowest_priority_running_request():
    sched = make_scheduler(scheduling_policy="priority", max_model_len=128, max_num_seqs=2)
    sched.add_request(make_request("mid", priority=3, arrival_time=1.0, max_tokens=20))
    sched.add_request(make_request("low", priority=5, arrival_time=2.0, max_tokens=20))
    step(sched)
    sched.add_request(make_request("urgent", max_tokens=4, priority=0, arrival_time=3.0))
    out = step(sched)
    assert out.preempted_req_ids == ["low"]
    assert scheduled_ids(out) == ["mid", "urgent"]
    assert sched.requests["low"].status == RequestStatus.PREEMPTED
    # Equal priority never preempts: a second "mid" waits for a slot.
    sched.add_request(make_request("mid2", max_tokens=4, priority=3, arrival_time=4.0))
    assert step(sched).preempted_req_ids == []


def test_priority_preempts_lowest_priority_when_blocks_run_out():
    """Four blocks: both requests grow, and the one of lower priority (not the newest) is preempted."""
    sched = make_scheduler(scheduling_policy="priority", max_model_len=128, num_blocks=4)
    sched.add_request(make_request("low", prompt=7, priority=9, arrival_time=1.0, max_tokens=20))
    sched.add_request(make_request("high", prompt=7, priority=1, arrival_time=2.0, max_tokens=20))
    preempted = []
    for _ in range(3):
        preempted += step(sched).preempted_req_ids
    assert preempted and set(preempted) == {"low"}


def test_short_first_orders_by_remaining_tokens():
    sched = make_scheduler(scheduling_policy="short-first", max_model_len=128, max_num_seqs=1)
    sched.add_request(make_request("long", prompt=40, max_tokens=40))
    sched.add_request(make_request("short", prompt=4, max_tokens=2))
    sched.add_request(make_request("medium", prompt=10, max_tokens=10))
    order = []
    while sched.has_unfinished_requests():
        for request_id in scheduled_ids(step(sched)):
            if request_id not in order:
                order.append(request_id)
    assert order == ["short", "medium", "long"]


@pytest.mark.parametrize("max_wait", [5.0, 20.0])
def test_short_first_admits_a_long_request_within_the_ageing_bound(monkeypatch, max_wait):
    """A new short request arrives every step and one runs at a time: without ageing the long request would
    wait forever. With it, the long request starts once it has waited max_wait (one clock unit per step), at the
    latest when the short request running at that moment finishes (two steps)."""
    clock = [0.0]
    monkeypatch.setattr(sched_policy.time, "monotonic", lambda: clock[0])
    sched = make_scheduler(scheduling_policy="short-first", max_model_len=128, max_num_seqs=1,
                           short_first_max_wait=max_wait)
    sched.add_request(make_request("long", prompt=40, max_tokens=40, arrival_time=0.0))
    started = None
    for n in range(200):
        sched.add_request(make_request(f"short{n}", prompt=4, max_tokens=2, arrival_time=clock[0]))
        if "long" in scheduled_ids(step(sched)):
            started = clock[0]
            break
        clock[0] += 1.0
    assert started is not None and max_wait <= started <= max_wait + 2


def test_first_beam_holds_slots_for_all_its_beams():
    """A beam search of width 3 holds three sequence slots from admission, so its forks never exceed
    max_num_seqs and a plain request waits instead."""
    sched = make_scheduler(scheduling_policy="fcfs", max_model_len=128, max_num_seqs=3)
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    beam = Request(request_id="b", prompt_token_ids=[100, 101, 102],
                   sampling_params=SamplingParams(temperature=0.0, logprobs=6, max_tokens=4, ignore_eos=True),
                   eos_token_ids=frozenset(), max_tokens=4)
    sched.add_request(beam, BeamGroup("b", params, frozenset()))
    sched.add_request(make_request("plain", max_tokens=4))
    assert scheduled_ids(sched.schedule()) == ["b"]
