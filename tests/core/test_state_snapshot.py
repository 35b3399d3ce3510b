"""The dashboard's snapshot of the scheduler and KV pools (core/state_snapshot.py) against the manager's own state:
every block's code agrees with its ref count and hash, the counts add up to the pool, each request lists its block
table, swapped-out requests their host blocks, and blocks never created count as free."""
from __future__ import annotations

import json

from scheduler_factories import make_request, make_scheduler

from pagellm.core.sched.scheduler import Scheduler
from pagellm.core.state_snapshot import MAX_LISTED_REQUESTS, engine_state

BLOCK_SIZE = 4


def run_step(scheduler: Scheduler, token: int = 7) -> None:
    """One step with a fake model: every scheduled request that finished its prompt samples `token`."""
    output = scheduler.schedule()
    sampled = {s.request_id: [token] for s in output.scheduled if s.needs_sample}
    scheduler.update_from_output(output, sampled)
    scheduler.kv_cache_manager.finish_step()


def expected_code(block) -> str:
    if block.ref_cnt > 1:
        return "s"
    if block.ref_cnt == 1:
        return "u"
    return "c" if block.block_hash is not None else "."


def assert_matches_manager(state: dict, scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    device = state["device"]
    assert device["states"] == "".join(expected_code(b) for b in manager.block_pool.blocks)
    assert sum(device["counts"].values()) == device["num_blocks"] == manager.block_pool.num_blocks
    assert device["counts"]["used"] + device["counts"]["shared"] == manager.block_pool.num_used_blocks
    listed = state["running"] + state["waiting"]
    assert [r["request_id"] for r in listed] == [r.request_id for r in scheduler.running + list(scheduler.waiting)]
    for entry in listed:
        assert entry["blocks"] == manager.get_block_ids(entry["request_id"])
    json.dumps(state)  # plain data only


def test_snapshot_of_prefix_hits_forks_and_finished_requests():
    scheduler = make_scheduler(num_blocks=32, block_size=BLOCK_SIZE, prefix_caching=True, max_num_seqs=16)
    shared_prefix = list(range(100, 112))  # three full blocks
    scheduler.add_request(make_request("a", shared_prefix + [1, 2], 8))
    run_step(scheduler)
    run_step(scheduler)  # "a" decodes, its three prompt blocks are cached
    scheduler.add_request(make_request("b", shared_prefix + [3], 8, priority=2))
    run_step(scheduler)  # "b" takes the cached prefix: those blocks are held twice
    state = engine_state(scheduler)
    assert_matches_manager(state, scheduler)
    assert state["device"]["states"][:3] == "sss" and state["device"]["counts"]["shared"] == 3
    b = next(r for r in state["running"] if r["request_id"] == "b")
    assert b["num_cached_tokens"] == 12 and b["priority"] == 2 and b["status"] == "running"
    assert b["num_prompt_tokens"] == 13 and b["num_computed_tokens"] == 13 and b["num_output_tokens"] == 1

    scheduler.abort_requests(["a", "b"])
    state = engine_state(scheduler)
    assert_matches_manager(state, scheduler)
    assert state["running"] == [] and state["device"]["counts"]["used"] == 0
    assert state["device"]["counts"]["cached"] == 4  # a's full blocks (16 computed tokens) stay cached, free
    assert set(state["device"]["states"]) <= {".", "c"}


def test_snapshot_lists_host_blocks_of_a_swapped_out_request_and_caps_the_queues():
    scheduler = make_scheduler(num_blocks=8, num_host_blocks=1000, block_size=BLOCK_SIZE, prefix_caching=True,
                               max_num_seqs=16)
    request = make_request("r", list(range(200, 210)), 8)
    scheduler.add_request(request)
    run_step(scheduler)
    scheduler.running.remove(request)
    scheduler.kv_cache_manager.swap_out(request)  # as a swap preemption does
    scheduler.kv_cache_manager.finish_step()  # the step's copy no longer holds the host blocks
    scheduler.waiting.appendleft(request)
    state = engine_state(scheduler)
    host = state["host"]
    assert host["num_blocks"] == 1000 and len(host["states"]) == 3  # only the blocks created so far are sent
    assert host["states"] == "uuu" and host["counts"] == {"free": 997, "cached": 0, "used": 3, "shared": 0}
    (waiting,) = state["waiting"]
    assert waiting["host_blocks"] == [0, 1, 2] and waiting["blocks"] == []

    for i in range(MAX_LISTED_REQUESTS + 5):
        scheduler.add_request(make_request(f"w{i}", [1, 2, 3], 8))
    state = engine_state(scheduler)
    assert state["num_waiting"] == MAX_LISTED_REQUESTS + 6 and len(state["waiting"]) == MAX_LISTED_REQUESTS
