"""Forked sequences in the scheduler and KV cache manager, with a fake model: n > 1 forks at the first sample,
copy-on-write of a shared partly filled block, and beam groups that must finish with the same result whatever
the pool size (beams waiting for siblings, preempted, recomputed)."""
from __future__ import annotations

import random

import pytest
from scheduler_factories import make_request, make_scheduler

from pagellm.core.beam_group import BeamGroup
from pagellm.core.kv.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.request import Request
from pagellm.core.sched.scheduler import Scheduler
from pagellm.sampling_params import BeamSearchParams, SamplingParams


def assert_ref_counts_match_tables(kv: KVCacheManager) -> None:
    holders: dict[int, int] = {}
    for blocks in kv.req_to_blocks.values():
        for block in blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in kv.block_pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
    assert kv.block_pool.num_used_blocks == len(holders)


# ---- copy-on-write -------------------------------------------------------------------------------------------
def forked_pair(kv: KVCacheManager, prompt_len: int) -> tuple[Request, Request]:
    """A request whose prompt is in the cache, and a fork of it sharing its blocks."""
    parent = make_request("p", prompt_len, 8, ignore_eos=True)
    assert kv.allocate_slots(parent, prompt_len)
    parent.num_computed_tokens = prompt_len
    child = parent.fork("p/1", 1)
    kv.fork(parent, child)
    return parent, child


def test_fork_shares_blocks_and_first_write_copies_the_partial_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    parent, child = forked_pair(kv, prompt_len=6)
    assert kv.get_block_ids("p/1") == kv.get_block_ids("p")
    assert [b.ref_cnt for b in kv.req_to_blocks["p"]] == [2, 2]
    assert_ref_counts_match_tables(kv)

    shared_full, shared_partial = kv.get_block_ids("p")
    assert kv.allocate_slots(child, 1)  # writes position 6, inside the shared second block
    new_block = kv.get_block_ids("p/1")[1]
    assert kv.get_block_ids("p/1") == [shared_full, new_block] and new_block != shared_partial
    assert kv.take_transfers().copies == [(shared_partial, new_block)]
    assert kv.take_transfers().copies == []
    # The parent is now the block's only holder: it writes in place, no copy.
    assert kv.allocate_slots(parent, 1)
    assert kv.get_block_ids("p") == [shared_full, shared_partial] and kv.take_transfers().copies == []
    assert_ref_counts_match_tables(kv)
    kv.free(child)
    kv.free(parent)
    assert kv.block_pool.num_free_blocks == 10


def test_fork_on_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    parent, child = forked_pair(kv, prompt_len=8)
    assert kv.allocate_slots(child, 1) and kv.allocate_slots(parent, 1)
    assert kv.take_transfers().copies == []
    assert kv.get_block_ids("p")[:2] == kv.get_block_ids("p/1")[:2]
    assert kv.get_block_ids("p")[2] != kv.get_block_ids("p/1")[2]
    assert_ref_counts_match_tables(kv)


def test_copy_on_write_without_a_free_block_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent, child = forked_pair(kv, prompt_len=6)
    assert not kv.allocate_slots(child, 1)
    assert kv.get_block_ids("p/1") == kv.get_block_ids("p") and kv.take_transfers().copies == []
    assert_ref_counts_match_tables(kv)


# ---- n > 1 ---------------------------------------------------------------------------------------------------
def test_n_forks_at_the_first_sample():
    sched = make_scheduler(num_blocks=32, max_num_seqs=16, max_num_batched_tokens=32)
    sched.add_request(make_request("r", 6, 2, n=3, ignore_eos=True))
    out = sched.schedule()
    (scheduled,) = out.scheduled
    assert scheduled.num_samples == 3
    updated, _ = sched.update_from_output(out, {"r": [7, 8, 9]})
    assert [(r.request_id, r.index, r.output_token_ids) for r in updated] == [
        ("r", 0, [7]), ("r/1", 1, [8]), ("r/2", 2, [9])]
    assert [r.request_id for r in sched.running] == ["r", "r/1", "r/2"]
    assert sched.groups == {"r": {"r", "r/1", "r/2"}}
    out = sched.schedule()
    assert all(s.num_samples == 1 for s in out.scheduled)
    # Two of the three sequences copy the shared partial block before writing into it.
    assert len(out.blocks_to_copy) == 2
    sched.update_from_output(out, {s.request_id: [1] for s in out.scheduled})
    assert not sched.has_unfinished_requests() and not sched.groups
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 32


def test_abort_by_request_id_aborts_every_sequence():
    sched = make_scheduler(num_blocks=32, max_num_seqs=16, max_num_batched_tokens=32)
    sched.add_request(make_request("r", 5, 8, n=4, ignore_eos=True))
    out = sched.schedule()
    sched.update_from_output(out, {"r": [1, 2, 3, 4]})
    aborted = sched.abort_requests(["r"])
    assert sorted(r.request_id for r in aborted) == ["r", "r/1", "r/2", "r/3"]
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 32


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler(num_blocks=8, max_num_seqs=16, max_num_batched_tokens=32)
    sched.add_request(make_request("r", 3, 8, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("r", 3, 8, ignore_eos=True))


# ---- beam groups ---------------------------------------------------------------------------------------------
def fake_candidates(tokens: list[int], k: int) -> tuple[list[int], list[float], list[int]]:
    """A deterministic 'model': the top-k (ids, logprobs) after `tokens`, as a logprobs entry (argmax first)."""
    rng = random.Random(hash(tuple(tokens)))
    ids = rng.sample(range(10, 500), k)
    values = sorted((-rng.uniform(0.1, 4.0) for _ in range(k)), reverse=True)
    return [ids[0]] + ids, [values[0]] + values, [1] + list(range(1, k + 1))


def run_beam_groups(num_blocks: int, prompts: list[list[int]], params: BeamSearchParams,
                    max_num_seqs: int = 8) -> tuple[dict, Scheduler]:
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=16)
    groups = {}
    for i, prompt in enumerate(prompts):
        request = Request(request_id=f"g{i}", prompt_token_ids=prompt,
                          sampling_params=SamplingParams(temperature=0.0, logprobs=2 * params.beam_width,
                                                         max_tokens=params.max_tokens, ignore_eos=True),
                          eos_token_ids=frozenset({11}), max_tokens=params.max_tokens)
        groups[request.request_id] = BeamGroup(request.request_id, params, frozenset({11}))
        sched.add_request(request, groups[request.request_id])
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert not out.is_empty
        entries = {s.request_id: [fake_candidates(sched.requests[s.request_id].all_token_ids, 2 * params.beam_width)]
                   for s in out.scheduled if s.needs_sample}
        sched.update_from_output(out, {r: [e[0][0][0]] for r, e in entries.items()}, entries)
        assert_ref_counts_match_tables(sched.kv_cache_manager)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.block_pool.num_free_blocks == num_blocks
    results = {g.request_id: [(s.tokens, round(s.cum_logprob, 9)) for s in g.result().sequences]
               for g in sched.take_finished_beam_groups()}
    return results, sched


def test_beam_groups_give_the_same_beams_in_any_pool():
    prompts = [list(range(100, 100 + n)) for n in (3, 9, 14)]
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    expected, _ = run_beam_groups(500, prompts, params)
    assert len(expected) == 3 and all(len(beams) == 3 for beams in expected.values())
    # The smallest pool a group of 3 beams of up to 24 tokens is guaranteed to fit in, and a few more.
    smallest = 3 * cdiv(14 + 10, 4)
    for max_num_seqs in (3, 4, 8):
        for num_blocks in range(smallest, smallest + 12):
            results, sched = run_beam_groups(num_blocks, prompts, params, max_num_seqs)
            assert results == expected, f"pool of {num_blocks} blocks, max_num_seqs={max_num_seqs}"


def test_held_beams_make_room_for_a_queued_sibling():
    """Built by hand: beams a1, a2 wait for a3, which is queued and does not fit because c1 (another group's
    beam, also waiting for a sibling) holds the rest of the pool. Nothing can run, so c1 is preempted to the
    back of the queue and a3 is admitted."""
    sched = make_scheduler(num_blocks=6, max_num_seqs=16, max_num_batched_tokens=32)
    kv = sched.kv_cache_manager
    params = SamplingParams(temperature=0.0, logprobs=2, ignore_eos=True)

    def beam(request_id: str, group_id: str) -> Request:
        request = Request(request_id=request_id, prompt_token_ids=list(range(8)), sampling_params=params,
                          eos_token_ids=frozenset(), max_tokens=4, group_id=group_id)
        sched.queues.add(request)  # several beams of one group: the transition, not add_request
        return request

    for request in (beam("a1", "A"), beam("a2", "A"), beam("c1", "C")):
        assert kv.allocate_slots(request, 8)
        request.num_computed_tokens = 8
        request.beam_candidates = ([1], [-0.5])
        sched.queues.admit(request, num_cached_tokens=0)
    beam("a3", "A")
    out = sched.schedule()
    assert out.preempted_req_ids == ["c1"]
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a3", 8)]
    assert [r.request_id for r in sched.waiting] == ["c1"] and sched.requests["c1"].beam_candidates is None
    assert_ref_counts_match_tables(kv)
