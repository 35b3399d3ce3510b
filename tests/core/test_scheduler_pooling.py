"""Pooling requests in the scheduler: prefill-only (never sampled), chunk contributions summed, finished with their
prompt and their blocks freed; LAST pooling reads the prefix cache and MEAN does not; recompute preemption restarts
the sum and swap keeps it; a missing pooled output fails the request alone. A fake worker returns, per pooling chunk,
a vector of its token count, so the sum must equal the prompt length exactly once."""
from __future__ import annotations

import numpy as np
import pytest
from scheduler_factories import TOKEN, make_request, make_scheduler

from pagellm.core.request import Request, RequestStatus
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


def pooling_request(request_id: str, prompt: int | list[int], pooling_type: str = "LAST") -> Request:
    params = PoolingParams(pooling_type=pooling_type, normalize=True,
                           skip_reading_prefix_cache=pooling_type != "LAST")
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return Request(request_id=request_id, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                   eos_token_ids=frozenset(), max_tokens=1, pooling_params=params)


def step(scheduler, drop: frozenset[str] = frozenset()):
    """One step with a fake worker; returns (output, finished requests)."""
    output = scheduler.schedule()
    pooled = {s.request_id: np.full(3, s.num_tokens, dtype=np.float32) for s in output.scheduled
              if scheduler.requests[s.request_id].pooling_params is not None and s.request_id not in drop}
    sampled = {s.request_id: [TOKEN] for s in output.scheduled if s.needs_sample}
    _, finished = scheduler.update_from_output(output, sampled, pooled=pooled)
    return output, finished


def test_chunks_sum_and_the_request_finishes_with_its_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=4, block_size=4)
    request = pooling_request("p", 10)
    scheduler.add_request(request)
    finished = []
    for _ in range(3):
        output, finished = step(scheduler)
        assert not any(s.needs_sample for s in output.scheduled)
    assert finished == [request] and request.status == RequestStatus.FINISHED_STOPPED
    np.testing.assert_array_equal(request.pooled_data, [10, 10, 10])
    assert request.output_token_ids == []
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
    scheduler.check_consistency()


def test_pooling_and_generation_share_a_step():
    scheduler = make_scheduler()
    generation, pooling = make_request("g", 6, max_tokens=3), pooling_request("p", 9)
    scheduler.add_request(generation)
    scheduler.add_request(pooling)
    output, finished = step(scheduler)
    assert {s.request_id: s.needs_sample for s in output.scheduled} == {"g": True, "p": False}
    assert finished == [pooling] and generation.output_token_ids == [TOKEN]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert generation.output_token_ids == [TOKEN] * 3
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.parametrize(("pooling_type", "num_cached"), [("LAST", 8), ("MEAN", 0), ("CLS", 0)])
def test_only_last_pooling_reads_the_prefix_cache(pooling_type, num_cached):
    scheduler = make_scheduler(prefix_caching=True, block_size=4)
    scheduler.add_request(pooling_request("first", 12))
    step(scheduler)
    again = pooling_request("again", 12, pooling_type)
    scheduler.add_request(again)
    output, finished = step(scheduler)
    # 12 tokens in 3 full blocks: the last token is computed, so at most 2 blocks come from the cache.
    assert output.scheduled[0].num_computed_tokens == again.num_cached_tokens == num_cached
    assert finished == [again]
    np.testing.assert_array_equal(again.pooled_data, [12 - num_cached] * 3)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_restarts_or_keeps_the_sum(mode):
    scheduler = make_scheduler(max_num_batched_tokens=4, block_size=4, num_host_blocks=16, preemption_mode=mode)
    request = pooling_request("p", 12, "MEAN")
    scheduler.add_request(request)
    step(scheduler)
    step(scheduler)
    np.testing.assert_array_equal(request.pooled_data, [8, 8, 8])
    scheduler.queues.preempt(request)
    if mode == "swap":
        np.testing.assert_array_equal(request.pooled_data, [8, 8, 8])
        assert request.num_computed_tokens == 8
    else:
        assert request.pooled_data is None and request.num_computed_tokens == 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
    np.testing.assert_array_equal(request.pooled_data, [12, 12, 12])  # each position counted once
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
    scheduler.check_consistency()


def test_a_missing_pooled_output_fails_the_request_alone():
    scheduler = make_scheduler()
    generation, pooling = make_request("g", 5, max_tokens=2), pooling_request("p", 5)
    scheduler.add_request(generation)
    scheduler.add_request(pooling)
    step(scheduler, drop=frozenset({"p"}))
    assert pooling.status == RequestStatus.FINISHED_ERROR
    assert "no pooled output" in scheduler.take_failed_groups()["p"]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert generation.output_token_ids == [TOKEN, TOKEN]
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
