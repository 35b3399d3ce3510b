"""Async scheduling in the scheduler, driven by hand: batch N+1 is scheduled before batch N's results are applied
(see core/sched/async_scheduling.py). Checked: which requests continue blind and where they continue, the worker's view
of their tokens (built from the diffs alone), results applied in order, requests that end in N, no block leaks; with
speculative decoding, that a request verifying a draft or about to draft waits and one with nothing to draft does
not."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from scheduler_factories import EOS, TOKEN, make_request, make_scheduler
from test_scheduler import blocks_of, ids
from test_scheduler_invariants import workloads

from pagellm.config import SchedulerConfig, SpeculativeConfig
from pagellm.core.beam_group import BeamGroup
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.request import RequestStatus
from pagellm.core.sched.async_scheduling import tokens_after_flight
from pagellm.core.sched.scheduler import Scheduler
from pagellm.sampling_params import BeamSearchParams
from pagellm.spec_decode import adaptive
from pagellm.worker.input_batch import InputBatch


def sampled_for(out, tokens: dict[str, int] | None = None) -> dict[str, list[int]]:
    tokens = tokens or {}
    return {s.request_id: [tokens.get(s.request_id, TOKEN)] * s.num_samples for s in out.scheduled if s.needs_sample}


def with_params(request, **changes):
    request.sampling_params = dataclasses.replace(request.sampling_params, **changes)
    return request


def test_a_decode_continues_blind_after_the_token_in_flight():
    sched = make_scheduler(async_scheduling=True, block_size=4)
    sched.add_request(make_request("r", prompt=3, max_tokens=10))
    worker = InputBatch()
    first = sched.schedule()
    assert [(s.num_computed_tokens, s.num_tokens, s.pending_token) for s in first.scheduled] == [(0, 3, False)]
    worker.update(first)
    assert sched.can_schedule_ahead()
    second = sched.schedule()  # the first is still out: the prompt's position 3 holds the token it samples
    (scheduled,) = second.scheduled
    assert (scheduled.num_computed_tokens, scheduled.num_tokens, scheduled.pending_token) == (3, 1, True)
    assert scheduled.new_token_ids == [] and scheduled.needs_sample
    # Position 3 is the first block's last slot; the second batch's sample (position 4) needs no block yet.
    assert len(blocks_of(sched, "r")) == 1
    (batched,) = worker.update(second)
    assert batched.pending_token and batched.token_ids == [0] and batched.num_computed_tokens == 3
    sched.update_from_output(first, sampled_for(first, {"r": 11}))
    third = sched.schedule()  # the second is out: position 4 holds its sample, in a new block
    assert [(s.num_computed_tokens, s.num_tokens, s.pending_token, s.new_token_ids) for s in third.scheduled] == [
        (4, 1, True, [11])]
    assert len(blocks_of(sched, "r")) == 2 and third.scheduled[0].new_block_ids == blocks_of(sched, "r")[1:]
    (batched,) = worker.update(third)
    assert worker.requests["r"].all_token_ids == [100, 101, 102, 11]  # the worker lags by the token in flight
    sched.update_from_output(second, sampled_for(second, {"r": 12}))
    sched.update_from_output(third, sampled_for(third, {"r": 13}))
    request = sched.requests["r"]
    assert request.output_token_ids == [11, 12, 13] and request.num_computed_tokens == 5
    sched.check_consistency()


def test_without_async_scheduling_a_request_in_flight_waits():
    sched = make_scheduler(async_scheduling=False)
    sched.add_request(make_request("r"))
    sched.schedule()
    assert sched.schedule().is_empty


def test_prompt_chunks_follow_each_other_without_waiting():
    sched = make_scheduler(async_scheduling=True, max_num_batched_tokens=4)
    sched.add_request(make_request("r", prompt=10))
    chunks = [sched.schedule() for _ in range(3)]
    assert [(s.num_computed_tokens, s.num_tokens, s.needs_sample, s.pending_token)
            for out in chunks for s in out.scheduled] == [(0, 4, False, False), (4, 4, False, False),
                                                          (8, 2, True, False)]


@pytest.mark.parametrize("kind", ["bad_words", "n", "beam"])
def test_requests_whose_next_step_depends_on_the_token_wait_for_it(kind):
    """Bad words are matched against the output on the host; the first sample of n > 1 forks; beams advance as a
    group: none of them continues blind, and the engine collects first (can_schedule_ahead is False)."""
    sched = make_scheduler(async_scheduling=True)
    request = make_request("r", max_tokens=8)
    if kind == "bad_words":
        request.bad_words_token_ids = [[5]]
    elif kind == "n":
        with_params(request, n=2, temperature=1.0, seed=0)
    beams = BeamGroup("r", BeamSearchParams(beam_width=2, max_tokens=4), frozenset()) if kind == "beam" else None
    sched.add_request(request, beams)
    sched.add_request(make_request("plain", max_tokens=8))
    sched.schedule()
    assert not sched.can_schedule_ahead()
    assert ids(sched.schedule().scheduled) == ["plain"]  # what the engine would not ask for: r stays behind


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.2, frequency_penalty=0.5), dict(min_tokens=3)],
                         ids=["penalties", "min_tokens"])
def test_penalties_and_min_tokens_continue_blind(params):
    """The worker counts the token in flight itself (tested end to end against the synchronous engine)."""
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(with_params(make_request("r", max_tokens=8), **params))
    sched.schedule()
    assert sched.can_schedule_ahead() and [s.pending_token for s in sched.schedule().scheduled] == [True]


def test_a_request_whose_token_in_flight_is_its_last_is_not_scheduled_again():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("r", max_tokens=1))
    first = sched.schedule()
    assert sched.can_schedule_ahead() and sched.schedule().is_empty
    sched.update_from_output(first, sampled_for(first))
    assert sched.requests == {} and sched.kv_cache_manager.block_pool.num_used_blocks == 0


def test_eos_in_flight_drops_the_blind_step_and_frees_every_block():
    sched = make_scheduler(async_scheduling=True, block_size=2)
    sched.add_request(make_request("r", prompt=4, max_tokens=10))
    sched.add_request(make_request("s", prompt=3, max_tokens=10))
    first = sched.schedule()
    second = sched.schedule()
    assert ids(second.scheduled) == ["r", "s"]
    _, finished = sched.update_from_output(first, sampled_for(first, {"r": EOS}))
    assert ids(finished) == ["r"] and sched.requests["s"].output_token_ids == [TOKEN]
    third = sched.schedule()
    assert ids(third.scheduled) == ["s"] and "r" in third.finished_req_ids
    updated, _ = sched.update_from_output(second, sampled_for(second))  # r's blind token is dropped
    assert ids(updated) == ["s"] and "r" not in sched.requests
    sched.update_from_output(third, sampled_for(third, {"s": EOS}))
    assert not sched.has_unfinished_requests() and not sched.in_flight
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 0
    sched.check_consistency()


def test_a_request_in_flight_is_never_preempted_and_a_full_pool_makes_it_wait():
    """The pool is full and the only candidates are in flight: the blind step is not scheduled (nobody may be
    preempted), and once the batch is back the usual preemption applies."""
    sched = make_scheduler(async_scheduling=True, num_blocks=2, block_size=4)
    sched.add_request(make_request("a", prompt=4, max_tokens=10))
    sched.add_request(make_request("b", prompt=4, max_tokens=10))
    first = sched.schedule()
    assert ids(first.scheduled) == ["a", "b"]
    assert sched.schedule().is_empty  # position 4 of each needs a third block
    sched.update_from_output(first, sampled_for(first))
    after = sched.schedule()
    assert ids(after.scheduled) == ["a"] and after.preempted_req_ids == ["b"]
    sched.check_consistency()


def test_an_abort_in_flight_ignores_both_late_results():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("r", max_tokens=10))
    first, second = sched.schedule(), sched.schedule()
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(first, sampled_for(first)) == ([], [])
    assert sched.update_from_output(second, sampled_for(second)) == ([], [])
    assert not sched.in_flight and sched.kv_cache_manager.block_pool.num_used_blocks == 0


def spec_scheduler(monkeypatch, prompt_lookup_min: int = 1):
    """Async scheduling with prompt lookup drafting up to 3 tokens, every draft its full length (the adaptive length
    follows this host's step times: see tests/spec_decode/test_adaptive.py for the rule itself)."""
    monkeypatch.setattr(adaptive, "best_length", lambda rate, max_k, *_: max_k)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=3)
    return make_scheduler(async_scheduling=True, block_size=4, speculative_config=spec)


def test_a_request_verifying_a_draft_or_about_to_draft_waits_for_its_batch(monkeypatch):
    """A verify step emits 1 to k + 1 tokens, so nothing may follow it blind; a request that would draft next waits
    too, since its draft is made from the token in flight. The engine then collects before scheduling."""
    sched = spec_scheduler(monkeypatch)
    sched.add_request(make_request("r", prompt=[5, 6, 7, 8] * 3, max_tokens=20))
    prefill = sched.schedule()
    first = sched.schedule()  # the first sample in flight: nothing to draft from yet, so the first decode runs blind
    assert [(s.pending_token, s.spec_token_ids) for s in first.scheduled] == [(True, [])]
    sched.update_from_output(prefill, sampled_for(prefill, {"r": 5}))
    assert not sched.can_schedule_ahead() and sched.schedule().is_empty  # r would draft: it waits for `first`
    sched.update_from_output(first, sampled_for(first, {"r": 6}))
    verify = sched.schedule()
    (scheduled,) = verify.scheduled
    # ... 5 6 7 8 5 6: the suffix 8 5 6 occurred before, followed by 7 8 5.
    assert (scheduled.pending_token, scheduled.spec_token_ids, scheduled.num_tokens) == (False, [7, 8, 5], 4)
    request = sched.requests["r"]
    assert tokens_after_flight(request, scheduled, 64) is None
    assert not sched.can_schedule_ahead() and sched.schedule().is_empty
    # Two drafts kept, the third rejected (the sample there is 9): three tokens emitted.
    sched.update_from_output(verify, {"r": [7, 8, 9, 1]})
    assert request.output_token_ids == [5, 6, 7, 8, 9] and request.num_computed_tokens == 12 + 4
    assert sched.spec_decoding_stats.num_accepted_tokens == 2
    after = sched.schedule()
    assert [(s.num_computed_tokens, s.pending_token, s.new_token_ids) for s in after.scheduled] == [
        (16, False, [7, 8, 9])]
    sched.check_consistency()


def test_a_request_with_nothing_to_draft_runs_blind_and_asks_again_later(monkeypatch):
    """Text that does not repeat: after an empty proposal the next decode runs blind (the engine keeps scheduling
    ahead), and the blind step counts toward the next proposal."""
    sched = spec_scheduler(monkeypatch, prompt_lookup_min=2)
    sched.add_request(make_request("r", prompt=4, max_tokens=20))
    prefill, first = sched.schedule(), sched.schedule()
    sched.update_from_output(prefill, sampled_for(prefill, {"r": 10}))
    sched.update_from_output(first, sampled_for(first, {"r": 11}))
    plain = sched.schedule()  # no bigram recurs: no draft
    assert [(s.pending_token, s.spec_token_ids) for s in plain.scheduled] == [(False, [])]
    assert sched.can_schedule_ahead()
    blind = sched.schedule()
    assert [(s.pending_token, s.spec_token_ids) for s in blind.scheduled] == [(True, [])]
    sched.update_from_output(plain, sampled_for(plain, {"r": 12}))
    assert not sched.can_schedule_ahead(), "after its quiet step it proposes again, so it waits"
    sched.update_from_output(blind, sampled_for(blind, {"r": 13}))
    assert sched.requests["r"].output_token_ids == [10, 11, 12, 13]
    sched.check_consistency()


# ---- random workloads, driven as EngineCore drives an async-scheduling scheduler --------------------------------
def run_async_workload(w) -> tuple[Scheduler, dict, dict[str, int]]:
    """Batches are submitted while one is in flight whenever can_schedule_ahead() allows, and collected oldest
    first. A fake worker keeps its view from the diffs alone, takes each pending token from the previous batch's
    samples (as the model runner does on the device), checks that every computed position holds the right token,
    and writes the batch's tokens into a fake cache at submission (never into a shared or cached block)."""
    from collections import deque

    from test_scheduler_invariants import MAX_MODEL_LEN, FakeKVCache, check_blocks

    config = SchedulerConfig(max_num_seqs=w.max_num_seqs,
                             max_num_batched_tokens=w.max_num_batched_tokens, enable_chunked_prefill=w.chunked,
                             scheduling_policy=w.policy, preemption_mode=w.preemption_mode, async_scheduling=True)
    kv_cache_manager = KVCacheManager(w.num_blocks, w.block_size, w.prefix_caching, w.num_host_blocks)
    sched = Scheduler(config, MAX_MODEL_LEN, kv_cache_manager)
    cache, worker, bs = FakeKVCache(w.num_blocks, w.num_host_blocks, w.block_size), InputBatch(), w.block_size
    specs = {s.request_id: s for s in w.specs}
    requests, aborted_at, in_flight, last_sampled = {}, {}, deque(), {}
    last_arrival = max(s.arrival for s in w.specs)
    max_steps = 2 * (last_arrival + sum(s.n for s in w.specs) * MAX_MODEL_LEN + 10)

    def truth(request_id: str, length: int) -> list[int]:
        request = requests[request_id]
        spec = specs[request.group_id]
        return (spec.prompt + [spec.token(request.index, k) for k in range(length - len(spec.prompt))])[:length]

    for step in range(max_steps):
        for s in w.specs:
            if s.arrival == step:
                requests[s.request_id] = s.make_request()
                sched.add_request(requests[s.request_id])
        to_abort = [s.request_id for s in w.specs if s.abort_at == step and s.request_id in requests]
        for r in sched.abort_requests(to_abort):
            aborted_at[r.group_id] = step
        if not sched.has_unfinished_requests() and not in_flight and step >= last_arrival:
            break
        if len(in_flight) < 2 and (not in_flight or sched.can_schedule_ahead()):
            out = sched.schedule()
            if not out.is_empty:
                cache.apply(out)
                new = {n.request_id for n in out.new_requests}
                sampled = {}
                for b in worker.update(out):
                    if b.pending_token:
                        b.token_ids[-1] = last_sampled[b.request_id]
                    end = b.num_computed_tokens + b.num_tokens
                    expected = truth(b.request_id, end)
                    assert b.token_ids == expected[b.num_computed_tokens:], b.request_id
                    check_from = 0 if b.request_id in new else max(b.num_computed_tokens - bs, 0)
                    cache.check_and_write(b, expected, sched.kv_cache_manager.req_to_blocks[b.request_id],
                                          check_from)
                    if b.needs_sample:
                        request = requests[b.request_id]
                        k = end - request.num_prompt_tokens
                        sampled[b.request_id] = [specs[request.group_id].token(request.index + j, k)
                                                 for j in range(b.num_samples)]
                last_sampled = {rid: tokens[0] for rid, tokens in sampled.items()}
                in_flight.append((out, sampled))
                check_blocks(sched)
                if len(in_flight) < 2:
                    continue  # as the engine: the first batch is not collected before a second is submitted
        if in_flight:
            out, sampled = in_flight.popleft()
            updated, _ = sched.update_from_output(out, sampled)
            for request in updated:
                requests.setdefault(request.request_id, request)  # forks
        check_blocks(sched)
    else:
        raise AssertionError("no progress")
    return sched, requests, aborted_at


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_async_scheduling_on_random_workloads(w):
    """Every request ends with the tokens the fake model gives it (a prefix of them if aborted), every computed
    position holds the right token, and every block comes back, with preemption, swaps, prefix hits, n > 1 and
    aborts in the mix."""
    from test_scheduler_invariants import MAX_MODEL_LEN

    sched, requests, aborted_at = run_async_workload(w)
    kv = sched.kv_cache_manager
    kv.finish_step()
    assert kv.block_pool.num_free_blocks == kv.num_blocks and kv.req_to_blocks == {} and not sched.in_flight
    assert sched.requests == {} and not sched.running and not sched.waiting
    specs = {spec.request_id: spec for spec in w.specs}
    for request in requests.values():
        want, reason = specs[request.group_id].expected(MAX_MODEL_LEN, request.index)
        if request.finish_reason == "abort":
            assert request.group_id in aborted_at and request.output_token_ids == want[:request.num_output_tokens]
        else:
            assert (request.output_token_ids, request.finish_reason) == (want, reason), request.request_id
