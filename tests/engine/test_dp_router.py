"""The data-parallel router (load, then prefix affinity within a slack) and the snapshot aggregation across
replicas, on plain values."""
from __future__ import annotations

import dataclasses

import pytest

from pagellm.core.request import Request
from pagellm.engine.dp_router import PREFIX_AFFINITY_SLACK, WAITING_WEIGHT, LoadAwareRouter
from pagellm.metrics.stats import SchedulerStats, aggregate_scheduler_stats
from pagellm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def idle(num_blocks: int = 64, **fields) -> SchedulerStats:
    return SchedulerStats(0, 0, 0, num_blocks, 0, **fields)


def request(tokens: list[int], salt: str | None = None) -> Request:
    return Request("r", tokens, SamplingParams(), frozenset(), 8, cache_salt=salt)


def test_requests_spread_by_load_and_come_back_when_released():
    router = LoadAwareRouter([idle(), idle(), idle()], BLOCK_SIZE, prefix_affinity=False)
    assert [router.route(request([i])) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    router.release(1, 2)
    assert router.route(request([7])) == 1


def test_waiting_requests_weigh_more_and_kv_usage_breaks_ties():
    router = LoadAwareRouter([idle(), idle()], BLOCK_SIZE, prefix_affinity=False)
    router.in_flight = [WAITING_WEIGHT, 2]
    router.observe(1, dataclasses.replace(idle(), num_running=1, num_waiting=1))  # load 2 + WAITING_WEIGHT
    assert router.route(request([1])) == 0
    router.in_flight = [3, 3]
    router.observe(1, idle())
    router.observe(0, dataclasses.replace(idle(), num_used_blocks=32))
    assert router.route(request([1])) == 1


def test_a_shared_prefix_goes_back_to_its_replica():
    router = LoadAwareRouter([idle(), idle()], BLOCK_SIZE, prefix_affinity=True)
    router.in_flight = [1, 0]
    prefix = list(range(100, 112))  # three full blocks
    assert router.route(request(prefix + [1, 2])) == 1  # least loaded
    router.in_flight = [0, 1]
    # Replica 0 is now less loaded, but replica 1 holds the prefix's blocks.
    assert router.route(request(prefix + [3, 4, 5])) == 1
    # A different salt is a different cache: no affinity.
    assert router.route(request(prefix + [3], salt="tenant-b")) == 0
    # A prompt shorter than a block has no full block to match.
    assert router.route(request([100, 101])) == 0


def test_affinity_gives_way_when_its_replica_is_too_busy():
    router = LoadAwareRouter([idle(), idle()], BLOCK_SIZE, prefix_affinity=True)
    prefix = list(range(100, 108))
    assert router.route(request(prefix)) == 0
    router.in_flight = [PREFIX_AFFINITY_SLACK, 0]
    assert router.route(request(prefix + [1])) == 0  # exactly the slack busier: still worth it
    router.in_flight = [PREFIX_AFFINITY_SLACK + 1, 0]
    assert router.route(request(prefix + [2])) == 1


def test_longest_matching_prefix_wins_and_old_blocks_are_forgotten():
    # Each replica remembers as many blocks as its pools hold: 3 here.
    router = LoadAwareRouter([idle(num_blocks=3), idle(num_blocks=3)], BLOCK_SIZE, prefix_affinity=True)
    short, long = list(range(100, 104)), list(range(100, 112))  # long starts with short's block
    too_busy = PREFIX_AFFINITY_SLACK + 1
    assert router.route(request(short)) == 0
    router.in_flight = [too_busy, 0]
    assert router.route(request(long)) == 1
    router.in_flight = [0, 0]
    assert router.route(request(long + [1])) == 1  # three blocks match there, one on replica 0
    router.in_flight = [0, too_busy]
    assert router.route(request(list(range(200, 212)))) == 0  # three new blocks push `short` out on replica 0
    router.in_flight = [0, 0]
    assert router.route(request(short)) == 1


@pytest.mark.parametrize("num_kv_cache_groups", [1, 3])
def test_the_recent_blocks_are_as_many_as_the_pools_hold_per_group(num_kv_cache_groups):
    """9 pages (6 device, 3 host) hold 9 prompt blocks of a one-group model but 3 of a model with three KV cache
    groups (Gemma 3's windows: a block is a page in each group), so there a fourth block forgets the first."""
    stats = idle(num_blocks=6, num_host_blocks=3, num_kv_cache_groups=num_kv_cache_groups)
    router = LoadAwareRouter([stats, stats], BLOCK_SIZE, prefix_affinity=True)
    first = list(range(100, 112))  # three blocks
    assert router.route(request(first)) == 0
    router.in_flight = [0, PREFIX_AFFINITY_SLACK + 1]
    assert router.route(request(list(range(200, 204)))) == 0  # a fourth block on replica 0
    router.in_flight = [1, 0]
    assert router.route(request(first + [1])) == (0 if num_kv_cache_groups == 1 else 1)


def test_aggregate_sums_counts_and_weights_token_efficiency():
    a = SchedulerStats(2, 1, 30, 100, 4, prefix_cache_queries=50, prefix_cache_hits=10, kv_cache_token_efficiency=0.5,
                       num_used_host_blocks=1, num_host_blocks=10, num_kv_cache_groups=6)
    b = SchedulerStats(1, 0, 10, 100, 1, prefix_cache_queries=20, prefix_cache_hits=20, kv_cache_token_efficiency=1.0,
                       num_used_host_blocks=0, num_host_blocks=10, num_kv_cache_groups=6)
    total = aggregate_scheduler_stats([a, b])
    assert (total.num_running, total.num_waiting, total.num_used_blocks, total.num_blocks) == (3, 1, 40, 200)
    assert (total.num_preemptions_total, total.prefix_cache_queries, total.prefix_cache_hits) == (5, 70, 30)
    assert (total.num_used_host_blocks, total.num_host_blocks) == (1, 20)
    assert total.num_kv_cache_groups == 6  # the model's, not a count to sum
    assert total.kv_cache_usage == pytest.approx(0.2)
    assert total.kv_cache_token_efficiency == pytest.approx((0.5 * 30 + 1.0 * 10) / 40)
    assert aggregate_scheduler_stats([a]) is a
