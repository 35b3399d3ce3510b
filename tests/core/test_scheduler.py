"""Deterministic unit tests of the scheduler, driven by hand: schedule(), fake sampled tokens, update_from_output()."""
from __future__ import annotations

import weakref

import pytest
from scheduler_factories import EOS, TOKEN, make_request, make_scheduler

from pagellm.config import SchedulerConfig
from pagellm.core.kv.kv_cache_manager import cdiv
from pagellm.core.request import RequestStatus
from pagellm.core.sched.scheduler import Scheduler
from pagellm.worker.input_batch import InputBatch

_worker_views: weakref.WeakKeyDictionary[Scheduler, InputBatch] = weakref.WeakKeyDictionary()


def schedule(sched: Scheduler):
    """schedule(sched), also applied to a worker's view of the sequences (built from the outputs' diffs alone);
    `out.batch` is what that worker runs: each sequence's tokens and whole block table."""
    out = sched.schedule()
    out.batch = _worker_views.setdefault(sched, InputBatch()).update(out)
    return out


def step(sched: Scheduler, tokens: dict[str, int] | None = None):
    """One engine step with a fake model; returns (output, updated, finished)."""
    out = schedule(sched)
    tokens = tokens or {}
    sampled = {s.request_id: [tokens.get(s.request_id, TOKEN)] * s.num_samples for s in out.scheduled if s.needs_sample}
    updated, finished = sched.update_from_output(out, sampled)
    return out, updated, finished


def plan(out) -> list[tuple[str, int]]:
    """(request id, number of tokens) for each scheduled request, in order."""
    return [(s.request_id, s.num_tokens) for s in out.scheduled]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def blocks_of(sched: Scheduler, request_id: str) -> list[int]:
    return sched.kv_cache_manager.get_block_ids(request_id)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> int:
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            return n
        step(sched)
    raise AssertionError("the scheduler did not finish its requests")


# ---- config ----------------------------------------------------------------------------------------------------
class TestSchedulerConfig:
    def test_no_chunked_prefill_needs_budget_of_max_model_len(self):
        with pytest.raises(ValueError) as info:
            SchedulerConfig(max_num_batched_tokens=64, enable_chunked_prefill=False).check_fits(128)
        message = str(info.value)
        for name in ("max_num_batched_tokens", "max_model_len", "--max-num-batched-tokens", "--max-model-len",
                     "chunked prefill", "64", "128"):
            assert name in message

    def test_budget_equal_to_max_model_len_is_fine_without_chunking(self):
        SchedulerConfig(max_num_batched_tokens=128, enable_chunked_prefill=False).check_fits(128)

    def test_small_budget_is_fine_with_chunking(self):
        SchedulerConfig(max_num_batched_tokens=1, enable_chunked_prefill=True).check_fits(128)

    @pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens"])
    def test_non_positive_limits_rejected(self, field):
        with pytest.raises(ValueError, match=field):
            SchedulerConfig(**{field: 0})


# ---- basics ----------------------------------------------------------------------------------------------------
def test_empty_scheduler_schedules_nothing():
    sched = make_scheduler()
    out = schedule(sched)
    assert out.is_empty and out.total_num_scheduled_tokens == 0
    assert out.preempted_req_ids == [] and out.finished_req_ids == []
    assert not sched.has_unfinished_requests()


def test_prefill_then_decode_bookkeeping():
    sched = make_scheduler(block_size=4)
    req = make_request("a", prompt=5, max_tokens=3)
    sched.add_request(req)
    assert req.status == RequestStatus.WAITING and ids(sched.waiting) == ["a"]

    out = schedule(sched)
    (s,) = out.batch
    assert (s.request_id, s.token_ids, s.num_computed_tokens, s.needs_sample) == ("a", req.prompt_token_ids, 0, True)
    assert s.block_ids == blocks_of(sched, "a") and len(s.block_ids) == 2
    assert s.sampling_params is req.sampling_params
    assert req.status == RequestStatus.RUNNING and ids(sched.running) == ["a"] and not sched.waiting
    updated, finished = sched.update_from_output(out, {"a": [11]})
    assert ids(updated) == ["a"] and finished == []
    assert req.num_computed_tokens == 5 and req.output_token_ids == [11]

    out, _, _ = step(sched, {"a": 12})
    (s,) = out.batch
    assert (s.token_ids, s.num_computed_tokens, s.needs_sample) == ([11], 5, True)
    out, _, finished = step(sched, {"a": 13})
    assert out.batch[0].token_ids == [12] and out.scheduled[0].num_computed_tokens == 6
    assert ids(finished) == ["a"]
    assert req.output_token_ids == [11, 12, 13]
    assert req.status == RequestStatus.FINISHED_LENGTH and req.finish_reason == "length"


# ---- continuous batching ---------------------------------------------------------------------------------------
def test_continuous_batching_join_and_leave():
    sched = make_scheduler(block_size=4, num_blocks=32)
    a, b = make_request("a", 4, max_tokens=3), make_request("b", 6, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    out, _, _ = step(sched)
    assert plan(out) == [("a", 4), ("b", 6)]
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]

    # A request that arrives while others run joins at the very next step, next to their decodes.
    c = make_request("c", 5, max_tokens=10)
    sched.add_request(c)
    out, _, finished = step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 5)]
    # a reached max_tokens=3 in this step: it leaves at once and its blocks are freed.
    assert ids(finished) == ["a"]
    assert a.is_finished and a not in sched.running
    assert "a" not in sched.kv_cache_manager.req_to_blocks
    assert "a" not in sched.requests
    used = sum(len(blocks_of(sched, r)) for r in ("b", "c"))
    assert sched.kv_cache_manager.block_pool.num_used_blocks == used

    out, _, _ = step(sched)
    assert plan(out) == [("b", 1), ("c", 1)]
    assert out.finished_req_ids == ["a"]  # workers hear about it on the next step
    out, _, _ = step(sched)
    assert out.finished_req_ids == []

    run_to_completion(sched)
    assert b.num_output_tokens == 10 and c.num_output_tokens == 10
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 32
    assert sched.kv_cache_manager.req_to_blocks == {}


def test_running_first_then_waiting_in_arrival_order():
    sched = make_scheduler(max_num_batched_tokens=10, block_size=4)
    a = make_request("a", 3)
    sched.add_request(a)
    step(sched)
    for rid, n in (("b", 4), ("c", 2), ("d", 9)):
        sched.add_request(make_request(rid, n))
    out, _, _ = step(sched)
    # The running decode comes first; then waiting requests in arrival order until the budget runs out
    # (d's prompt is chunked into what is left).
    assert plan(out) == [("a", 1), ("b", 4), ("c", 2), ("d", 3)]
    assert out.total_num_scheduled_tokens == 10
    assert ids(sched.running) == ["a", "b", "c", "d"]
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 1), ("d", 6)]


def test_waiting_queue_is_fcfs_even_when_a_later_request_would_fit():
    sched = make_scheduler(max_model_len=16, num_blocks=4, block_size=4, max_num_batched_tokens=16)
    a = make_request("a", 8, max_tokens=4)
    sched.add_request(a)
    step(sched)  # a holds 2 blocks; its next decode (position 8) takes a third, leaving 1 free
    sched.add_request(make_request("b", 12))  # needs 3 blocks: does not fit now
    sched.add_request(make_request("c", 1))   # would fit in the free block, but must not jump the queue
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1)]
    assert ids(sched.waiting) == ["b", "c"]


# ---- chunked prefill -------------------------------------------------------------------------------------------
def test_long_prompt_is_chunked_and_only_the_last_chunk_samples():
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    req = make_request("a", prompt=20, max_tokens=2)
    sched.add_request(req)
    seen = []
    for expected_start, expected_len, expected_sample in ((0, 8, False), (8, 8, False), (16, 4, True)):
        out = schedule(sched)
        (s,) = out.batch
        assert (s.num_computed_tokens, s.num_tokens, s.needs_sample) == (expected_start, expected_len,
                                                                           expected_sample)
        assert s.token_ids == req.prompt_token_ids[expected_start:expected_start + expected_len]
        assert len(s.block_ids) == cdiv(expected_start + expected_len, 4)
        seen += s.token_ids
        # The fake model returns a token for every request; a non-final chunk must ignore it.
        updated, finished = sched.update_from_output(out, {"a": [55]})
        assert finished == []
        if expected_sample:
            assert ids(updated) == ["a"] and req.output_token_ids == [55]
        else:
            assert updated == [] and req.output_token_ids == []
            assert req.num_tokens == 20
        assert req.num_computed_tokens == expected_start + expected_len
    assert seen == req.prompt_token_ids
    out, _, finished = step(sched)
    assert plan(out) == [("a", 1)] and out.batch[0].token_ids == [55]
    assert ids(finished) == ["a"] and req.output_token_ids == [55, TOKEN]


def test_decodes_share_a_step_with_a_prefill_chunk():
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    a, b = make_request("a", 3, max_tokens=10), make_request("b", 2, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    long = make_request("c", prompt=15, max_tokens=3)
    sched.add_request(long)
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 6)]
    assert [s.needs_sample for s in out.scheduled] == [True, True, False]
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 6)]
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 3)]
    assert out.scheduled[2].needs_sample and long.num_output_tokens == 1
    assert a.num_output_tokens == b.num_output_tokens == 4


def test_without_chunked_prefill_a_prompt_larger_than_the_remaining_budget_waits():
    sched = make_scheduler(max_model_len=16, max_num_batched_tokens=16, enable_chunked_prefill=False, block_size=4)
    a = make_request("a", 4, max_tokens=3)
    sched.add_request(a)
    step(sched)
    b = make_request("b", 16, max_tokens=1)
    c = make_request("c", 1, max_tokens=1)
    sched.add_request(b)
    sched.add_request(c)
    out, _, _ = step(sched)
    # 1 (a's decode) + 16 > 16: b waits whole, and c does not overtake it.
    assert plan(out) == [("a", 1)]
    assert ids(sched.waiting) == ["b", "c"] and b.num_computed_tokens == 0
    out, _, finished = step(sched)
    assert plan(out) == [("a", 1)] and ids(finished) == ["a"]
    out, _, finished = step(sched)
    assert plan(out) == [("b", 16)]  # the whole prompt in one go once the budget is free
    assert out.scheduled[0].needs_sample
    out, _, _ = step(sched)
    assert plan(out) == [("c", 1)]


def test_without_chunked_prefill_a_prompt_that_fits_is_never_split():
    sched = make_scheduler(max_model_len=32, max_num_batched_tokens=32, enable_chunked_prefill=False)
    for rid, n in (("a", 20), ("b", 10), ("c", 5)):
        sched.add_request(make_request(rid, n))
    out, _, _ = step(sched)
    assert plan(out) == [("a", 20), ("b", 10)]
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 5)]


# ---- max_num_seqs ----------------------------------------------------------------------------------------------
def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", 3, max_tokens=2 + i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out, _, _ = step(sched)
    assert plan(out) == [("r0", 3), ("r1", 3)]
    assert ids(sched.running) == ["r0", "r1"] and ids(sched.waiting) == ["r2", "r3"]
    out, _, finished = step(sched)
    assert plan(out) == [("r0", 1), ("r1", 1)] and ids(finished) == ["r0"]
    out, _, _ = step(sched)  # r0's slot goes to r2 at the next step
    assert plan(out) == [("r1", 1), ("r2", 3)]
    while sched.has_unfinished_requests():
        out, _, _ = step(sched)
        assert len(out.scheduled) <= 2 and len(sched.running) <= 2
    assert [r.num_output_tokens for r in reqs] == [2, 3, 4, 5]


# ---- preemption ------------------------------------------------------------------------------------------------
def test_preemption_of_the_most_recently_admitted_request():
    sched = make_scheduler(max_model_len=16, num_blocks=4, block_size=4, max_num_batched_tokens=16)
    pool = sched.kv_cache_manager.block_pool
    a, b = make_request("a", 6, max_tokens=6), make_request("b", 6, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out, _, _ = step(sched, {"a": 21, "b": 31})
    assert plan(out) == [("a", 6), ("b", 6)] and pool.num_free_blocks == 0
    step(sched, {"a": 22, "b": 32})
    step(sched, {"a": 23, "b": 33})
    assert (a.num_computed_tokens, b.num_computed_tokens) == (8, 8)
    b_blocks = blocks_of(sched, "b")

    c = make_request("c", 1)  # arrives just before the step that preempts
    sched.add_request(c)
    out, _, _ = step(sched, {"a": 24})
    # a needs a third block for position 8; none is free, so b (admitted last) is preempted.
    assert out.preempted_req_ids == ["b"]
    assert plan(out) == [("a", 1)]  # no admissions in a step that preempts
    assert b.status == RequestStatus.PREEMPTED and not b.is_finished
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [31, 32, 33]  # outputs are kept for recompute
    assert "b" not in sched.kv_cache_manager.req_to_blocks or blocks_of(sched, "b") == []
    assert all(pool.blocks[i].ref_cnt == 0 for i in b_blocks if i not in blocks_of(sched, "a"))
    assert ids(sched.running) == ["a"] and ids(sched.waiting) == ["b", "c"]  # b goes to the FRONT
    assert sched.num_preemptions_total == 1 and sched.stats().num_preemptions_total == 1
    assert len(blocks_of(sched, "a")) == 3 and pool.num_free_blocks == 1

    # b needs 3 blocks for 9 tokens and only 1 is free: it waits (and c waits behind it).
    out, _, _ = step(sched, {"a": 25})
    assert plan(out) == [("a", 1)] and out.preempted_req_ids == []
    out, _, finished = step(sched, {"a": 26})
    assert ids(finished) == ["a"] and a.output_token_ids == [21, 22, 23, 24, 25, 26]

    # Recompute: b is scheduled from position 0 with prompt + outputs so far, and samples its next token.
    out, _, _ = step(sched, {"b": 34})
    assert plan(out)[0] == ("b", 9)
    s = out.batch[0]
    assert s.token_ids == b.prompt_token_ids + [31, 32, 33]
    assert s.num_computed_tokens == 0 and s.needs_sample
    assert b.output_token_ids == [31, 32, 33, 34]
    assert b.status == RequestStatus.RUNNING
    run_to_completion(sched)
    assert b.output_token_ids[:4] == [31, 32, 33, 34] and b.num_output_tokens == 5
    assert b.finish_reason == "length" and c.finish_reason == "length"
    assert pool.num_free_blocks == 4 and sched.kv_cache_manager.req_to_blocks == {}


def test_last_running_request_preempts_itself():
    sched = make_scheduler(max_model_len=12, num_blocks=3, block_size=4, max_num_batched_tokens=16)
    a, b = make_request("a", 6, max_tokens=4), make_request("b", 4, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 2 blocks, b: 1 block, pool full
    out, _, _ = step(sched)
    # b's decode (position 4) needs a new block; b is itself the most recent, so it is the victim.
    assert out.preempted_req_ids == ["b"]
    assert plan(out) == [("a", 1)]
    assert ids(sched.waiting) == ["b"] and b.num_computed_tokens == 0 and b.num_output_tokens == 1
    run_to_completion(sched)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 3


def test_two_preemptions_in_one_step_keep_admission_order_in_the_waiting_queue():
    sched = make_scheduler(max_model_len=8, num_blocks=4, block_size=2, max_num_batched_tokens=8)
    reqs = [make_request(r, 1, max_tokens=5) for r in "abcd"]
    for r in reqs:
        sched.add_request(r)
    step(sched)  # one block each: the pool is full
    step(sched)  # positions 1: still in the first block
    out, _, _ = step(sched)  # positions 2: everyone needs a second block
    assert out.preempted_req_ids == ["d", "c"]
    assert plan(out) == [("a", 1), ("b", 1)]
    assert ids(sched.waiting) == ["c", "d"]  # c was admitted before d, and comes back before it
    assert sched.num_preemptions_total == 2
    run_to_completion(sched)
    assert [r.num_output_tokens for r in reqs] == [5, 5, 5, 5]
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 4


# ---- stop conditions -------------------------------------------------------------------------------------------
def test_eos_stops():
    sched = make_scheduler()
    req = make_request("a", max_tokens=10)
    sched.add_request(req)
    step(sched)
    _, _, finished = step(sched, {"a": EOS})
    assert ids(finished) == ["a"]
    assert req.output_token_ids == [TOKEN, EOS]  # the eos token is part of the output
    assert req.status == RequestStatus.FINISHED_STOPPED and req.finish_reason == "stop"
    assert req.stop_reason is None


def test_any_of_several_eos_ids_stops():
    sched = make_scheduler()
    req = make_request("a", max_tokens=10, eos_token_ids=frozenset({2, 3}))
    sched.add_request(req)
    _, _, finished = step(sched, {"a": 3})
    assert ids(finished) == ["a"] and req.finish_reason == "stop"


def test_ignore_eos_keeps_going_until_max_tokens():
    sched = make_scheduler()
    req = make_request("a", max_tokens=4, ignore_eos=True)
    sched.add_request(req)
    for _ in range(3):
        _, _, finished = step(sched, {"a": EOS})
        assert finished == []
    _, _, finished = step(sched, {"a": EOS})
    assert ids(finished) == ["a"] and req.output_token_ids == [EOS] * 4
    assert req.finish_reason == "length"


def test_no_eos_when_the_model_has_none():
    sched = make_scheduler()
    req = make_request("a", max_tokens=3, eos_token_ids=frozenset())
    sched.add_request(req)
    run_to_completion(sched)
    assert req.num_output_tokens == 3 and req.finish_reason == "length"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_token_ids_stop_with_the_token_as_reason(ignore_eos):
    sched = make_scheduler()
    req = make_request("a", max_tokens=10, stop_token_ids=(40, 41), ignore_eos=ignore_eos)
    sched.add_request(req)
    step(sched, {"a": 39})
    _, _, finished = step(sched, {"a": 41})
    assert ids(finished) == ["a"] and req.output_token_ids == [39, 41]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.finish_reason == "stop"
    assert req.stop_reason == 41


def test_stop_token_in_prompt_does_not_stop():
    sched = make_scheduler()
    req = make_request("a", prompt=3, max_tokens=2, stop_token_ids=(101,))
    sched.add_request(req)
    run_to_completion(sched)
    assert req.num_output_tokens == 2 and req.finish_reason == "length"


def test_max_tokens_stops_with_length():
    sched = make_scheduler()
    req = make_request("a", prompt=4, max_tokens=1)
    sched.add_request(req)
    _, _, finished = step(sched)
    assert ids(finished) == ["a"] and req.output_token_ids == [TOKEN]
    assert req.status == RequestStatus.FINISHED_LENGTH and req.finish_reason == "length"
    assert req.stop_reason is None


def test_max_model_len_stops_with_length():
    sched = make_scheduler(max_model_len=12)
    req = make_request("a", prompt=9, max_tokens=100)
    sched.add_request(req)
    assert run_to_completion(sched) == 3
    assert req.num_output_tokens == 3 and req.num_tokens == 12
    assert req.finish_reason == "length"


def test_prompt_of_exactly_max_model_len_gets_one_token():
    # The input processor admits prompts of up to max_model_len tokens; such a prompt samples once and stops.
    sched = make_scheduler(max_model_len=8, num_blocks=2, block_size=4, max_num_batched_tokens=8,
                           enable_chunked_prefill=False)
    req = make_request("a", prompt=8, max_tokens=100)
    sched.add_request(req)
    assert run_to_completion(sched) == 1
    assert req.num_output_tokens == 1 and req.finish_reason == "length"
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 2


def test_eos_on_the_last_allowed_token_counts_as_stop():
    sched = make_scheduler()
    req = make_request("a", max_tokens=2)
    sched.add_request(req)
    step(sched)
    step(sched, {"a": EOS})
    assert req.finish_reason == "stop" and req.num_output_tokens == 2


# ---- abort -----------------------------------------------------------------------------------------------------
def test_abort_running_and_waiting_requests_frees_their_blocks():
    sched = make_scheduler(max_num_seqs=2, num_blocks=16, block_size=4)
    a, b, c, d = (make_request(r, 5, max_tokens=10) for r in "abcd")
    for r in (a, b, c, d):
        sched.add_request(r)
    step(sched)
    assert ids(sched.running) == ["a", "b"] and ids(sched.waiting) == ["c", "d"]
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_used_blocks == 4

    aborted = sched.abort_requests(["b", "c", "nope"])
    assert ids(aborted) == ["b", "c"]
    for r in (b, c):
        assert r.status == RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
        assert r.request_id not in sched.kv_cache_manager.req_to_blocks and r.request_id not in sched.requests
    assert ids(sched.running) == ["a"] and ids(sched.waiting) == ["d"]
    assert pool.num_used_blocks == 2 and pool.num_used_blocks == len(blocks_of(sched, "a"))
    assert all(pool.blocks[i].ref_cnt == 1 for i in blocks_of(sched, "a"))

    assert sched.abort_requests(["b"]) == []  # already finished: ignored
    out, _, _ = step(sched)
    assert sorted(out.finished_req_ids) == ["b", "c"]
    assert plan(out) == [("a", 1), ("d", 5)]

    sched.abort_requests(["a", "d"])
    assert not sched.has_unfinished_requests()
    assert pool.num_free_blocks == 16 and sched.kv_cache_manager.req_to_blocks == {}
    assert schedule(sched).is_empty


def test_abort_a_preempted_request():
    sched = make_scheduler(max_model_len=12, num_blocks=3, block_size=4, max_num_batched_tokens=16)
    a, b = make_request("a", 6, max_tokens=4), make_request("b", 4, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out, _, _ = step(sched)
    assert out.preempted_req_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    assert ids(sched.abort_requests(["b"])) == ["b"]
    assert b.finish_reason == "abort" and not sched.waiting
    run_to_completion(sched)
    assert a.num_output_tokens == 4
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 3 and sched.kv_cache_manager.req_to_blocks == {}


def test_stats():
    sched = make_scheduler(max_num_seqs=1, num_blocks=10, block_size=4)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    step(sched)
    st = sched.stats()
    assert (st.num_running, st.num_waiting, st.num_preemptions_total) == (1, 1, 0)
    assert st.kv_cache_usage == pytest.approx(0.2)  # 8 computed tokens: 2 of 10 blocks (the sample has no slot yet)


def test_finish_requests_stopped_by_a_stop_string_frees_blocks_and_sets_stop_reason():
    sched = make_scheduler(max_num_seqs=2, num_blocks=16, block_size=4)
    a, b = make_request("a", 5, max_tokens=10), make_request("b", 5, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    pool = sched.kv_cache_manager.block_pool
    finished = sched.finish_requests(["a", "nope"], RequestStatus.FINISHED_STOPPED, stop_reasons={"a": "###"})
    assert ids(finished) == ["a"]
    assert (a.finish_reason, a.stop_reason) == ("stop", "###")
    assert "a" not in sched.requests and "a" not in sched.kv_cache_manager.req_to_blocks
    assert ids(sched.running) == ["b"] and pool.num_used_blocks == len(blocks_of(sched, "b"))
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED) == []  # already finished: ignored
    out, _, _ = step(sched)
    assert out.finished_req_ids == ["a"] and plan(out) == [("b", 1)]


def test_batches_in_flight_never_share_a_request_and_are_never_preempted():
    """A pipeline's batch queue: two batches split the requests; a request in flight is neither scheduled again
    nor chosen as a victim; an abort in flight reaches the workers with the next batch that runs, and its late
    result is ignored."""
    sched = make_scheduler(num_blocks=5, block_size=4)  # four 4-token prompts take 4 blocks: 1 left to grow
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt=4))
    first = sched.schedule(max_scheduled=2)
    second = sched.schedule(max_scheduled=2)
    assert ids(first.scheduled) == ["r0", "r1"] and ids(second.scheduled) == ["r2", "r3"]
    assert sched.schedule(max_scheduled=2).is_empty  # everything is in flight
    sched.update_from_output(first, {"r0": [TOKEN], "r1": [TOKEN]})
    # r0 and r1 each need a fifth slot, a new block, and one is free: r1 must make room, and r2 and r3 (in flight)
    # may not be the victims, so r1 preempts itself.
    third = sched.schedule(max_scheduled=2)
    assert ids(third.scheduled) == ["r0"] and third.preempted_req_ids == ["r1"]
    sched.finish_requests(["r3"], RequestStatus.FINISHED_ABORTED)  # aborted while its batch runs
    sched.update_from_output(second, {"r2": [TOKEN], "r3": [TOKEN]})  # r3's result is ignored: it is gone
    assert sched.requests["r2"].output_token_ids == [TOKEN] and "r3" not in sched.requests
    sched.update_from_output(third, {"r0": [TOKEN]})
    assert "r3" in sched.schedule(max_scheduled=2).finished_req_ids
    sched.check_consistency()
