"""Failures in the scheduler, with a fake model: a request whose results cannot be applied fails alone with its
whole group (blocks freed, reason reported once), the accounting check catches corrupted state, and admission
counts only the requests that truly wait for capacity."""
from __future__ import annotations

import pytest
from scheduler_factories import TOKEN, make_request, make_scheduler

from pagellm.core.request import RequestStatus
from pagellm.core.sched import results as sched_results
from pagellm.core.sched.scheduler import Scheduler


def step(sched: Scheduler, failed: dict[str, str] | None = None):
    out = sched.schedule()
    sampled = {s.request_id: [TOKEN] * s.num_samples for s in out.scheduled if s.needs_sample}
    return sched.update_from_output(out, sampled, failed=failed)


def used_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.num_used_blocks


def test_a_request_whose_update_raises_fails_alone_with_its_whole_group(monkeypatch):
    sched = make_scheduler(num_blocks=32)
    sched.add_request(make_request("pair", 6, 8, n=2))
    sched.add_request(make_request("other", 6, 8))
    step(sched)  # prefill; "pair" forks into pair and pair/1, sharing blocks
    assert sched.groups["pair"] == {"pair", "pair/1"}
    check_stop = sched_results.check_stop

    def broken_for_pair(request, max_model_len):
        if request.group_id == "pair" and request.index == 1:
            raise RuntimeError("injected")
        return check_stop(request, max_model_len)

    monkeypatch.setattr(sched_results, "check_stop", broken_for_pair)
    held_by_other = len(sched.kv_cache_manager.get_block_ids("other"))
    updated, finished = step(sched)
    assert [r.request_id for r in updated] == ["other"] and not finished
    assert sched.take_failed_groups() == {"pair": "RuntimeError: injected"}
    assert sched.take_failed_groups() == {}  # reported once
    assert "pair" not in sched.groups and set(sched.requests) == {"other"}
    assert used_blocks(sched) == held_by_other
    sched.check_consistency()
    monkeypatch.undo()
    while sched.has_unfinished_requests():
        step(sched)
    assert used_blocks(sched) == 0


def test_a_failure_after_a_sibling_finished_in_the_same_update_still_fails_the_group(monkeypatch):
    """The parent stops at its first token; applying its fork's token then raises. The failure is the group's,
    so the fork is freed and reported even though the sequence that was being updated is already finished."""
    sched = make_scheduler(num_blocks=32)
    sched.add_request(make_request("pair", 6, 8, n=2, stop_token_ids=(TOKEN,)))
    check_stop = sched_results.check_stop

    def broken_for_the_fork(request, max_model_len):
        if request.index == 1:
            raise RuntimeError("injected")
        return check_stop(request, max_model_len)

    monkeypatch.setattr(sched_results, "check_stop", broken_for_the_fork)
    updated, _ = step(sched)
    assert updated == [] and sched.take_failed_groups() == {"pair": "RuntimeError: injected"}
    assert not sched.requests and not sched.has_unfinished_requests() and used_blocks(sched) == 0
    sched.check_consistency()


def test_the_slots_of_a_future_fork_are_held_through_a_chunked_prefill():
    """A 40-token prompt with n=4 prefills in 16-token chunks on 4 sequence slots: nothing else is admitted into
    its three future sequences' slots meanwhile."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    sched.add_request(make_request("four", 40, 8, n=4))
    for i in range(3):
        sched.add_request(make_request(f"late{i}", 6, 8))
    most = 0
    while sched.has_unfinished_requests():
        step(sched)
        most = max(most, len(sched.running))
        assert len(sched.running) <= 4
    assert most == 4


def test_worker_failures_fail_those_requests_and_no_others():
    sched = make_scheduler(num_blocks=32)
    for request_id in ("a", "b", "c"):
        sched.add_request(make_request(request_id, 6, 8))
    updated, _ = step(sched, failed={"b": "ValueError: bad row"})
    assert [r.request_id for r in updated] == ["a", "c"]
    assert sched.take_failed_groups() == {"b": "ValueError: bad row"}
    assert set(sched.requests) == {"a", "c"} and sched.requests["a"].num_output_tokens == 1
    sched.check_consistency()


def test_failing_an_unknown_or_finished_request_is_ignored():
    sched = make_scheduler(num_blocks=32)
    sched.fail_requests({"nobody": "gone"})
    assert sched.take_failed_groups() == {}


def test_check_consistency_catches_broken_accounting():
    sched = make_scheduler(num_blocks=32)
    sched.add_request(make_request("a", 6, 8))
    sched.add_request(make_request("b", 6, 8))
    step(sched)
    sched.check_consistency()
    block = sched.kv_cache_manager.req_to_blocks["a"][0]
    block.ref_cnt += 1
    with pytest.raises(RuntimeError, match="ref counts"):
        sched.check_consistency()
    block.ref_cnt -= 1
    sched.kv_cache_manager.req_to_blocks["ghost"] = []
    with pytest.raises(RuntimeError, match="ghost"):
        sched.check_consistency()
    del sched.kv_cache_manager.req_to_blocks["ghost"]
    sched.running.remove(sched.requests["b"])
    with pytest.raises(RuntimeError, match="queues"):
        sched.check_consistency()


def test_waiting_for_capacity_counts_only_what_cannot_start_now():
    sched = make_scheduler(num_blocks=12, max_num_seqs=4)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 6, 8))  # 2 blocks each
    assert sched.num_waiting_for_capacity() == 0  # a burst that fits is not a backlog
    sched.add_request(make_request("late", 6, 8))  # the fourth slot
    assert sched.num_waiting_for_capacity() == 0
    sched.add_request(make_request("pair", 6, 8, n=2))  # will fork into two sequences: no two slots left
    assert sched.num_waiting_for_capacity() == 1
    step(sched)
    assert len(sched.running) == 4 and sched.num_waiting_for_capacity() == 1
    forked = False
    while sched.has_unfinished_requests():
        step(sched)
        forked |= "pair/1" in sched.requests
        assert len(sched.running) <= 4  # admission reserved both of its slots before it forked
    assert forked

    sched = make_scheduler(num_blocks=5, max_num_seqs=8)
    sched.add_request(make_request("long", 16, 8))  # 4 blocks
    sched.add_request(make_request("short", 4, 8))  # 1 block
    sched.add_request(make_request("blocked", 4, 8))  # no block left
    assert sched.num_waiting_for_capacity() == 1
    assert sched.requests["blocked"].status == RequestStatus.WAITING
