"""KV cache groups (vLLM's hybrid layout): how layers are grouped, and the manager's tables per group over one pool.
A full-attention group keeps every block; a sliding group (window W) frees the blocks wholly before the next
query's window (a query at q reads keys q - W < k <= q). The expected blocks follow from that rule, written out
here; check_consistency covers every group after each operation."""
from __future__ import annotations

import pytest
from scheduler_factories import compute, make_request

from pagellm.core.kv.kv_cache_groups import blocks_needed, group_size, kv_cache_groups, layer_positions
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.kv.prefix_hit import group_key
from pagellm.core.kv.sliding_window import NULL_BLOCK
from pagellm.core.state_snapshot import engine_state

BS, W = 4, 8
WINDOWS = [None, W, W]  # one full group, two sliding groups


def gemma3_windows(num_layers: int, window: int = 512) -> list[int | None]:
    """Gemma 3's pattern: every sixth layer global."""
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def first_block_read(num_computed: int) -> int:
    return max(0, num_computed - W + 1) // BS


def tables(kv: KVCacheManager, request_id: str) -> list[list]:
    return [group.req_to_blocks[request_id] for group in kv.groups]


def test_gemma3_270m_layers_form_one_full_and_five_sliding_groups_of_three():
    groups = kv_cache_groups(gemma3_windows(18))
    assert [(g.window, g.layers) for g in groups] == [
        (None, (5, 11, 17)), (512, (0, 1, 2)), (512, (3, 4, 6)), (512, (7, 8, 9)), (512, (10, 12, 13)),
        (512, (14, 15, 16))]
    assert group_size(groups) == 3
    positions = layer_positions(groups)
    assert sorted(positions) == list(range(18)) and {p for _, p in positions.values()} == {0, 1, 2}


def test_a_type_with_a_remainder_gets_a_smaller_last_group():
    groups = kv_cache_groups(gemma3_windows(26))  # Gemma 3 1B: 4 global, 22 local layers
    assert [len(g.layers) for g in groups] == [4, 4, 4, 4, 4, 4, 2] and groups[0].window is None
    assert group_size(groups) == 4


@pytest.mark.parametrize("windows", [[None] * 5, [W] * 5])
def test_a_uniform_model_is_one_group_of_every_layer(windows):
    assert [(g.window, g.layers) for g in kv_cache_groups(windows)] == [(windows[0], tuple(range(5)))]


def test_each_group_frees_by_its_own_window():
    kv = KVCacheManager(num_blocks=32, block_size=BS, group_windows=WINDOWS)
    request = make_request("a", 20)
    compute(kv, request, 20)
    assert kv.block_pool.num_used_blocks == 3 * 5
    compute(kv, request, 1)  # the query at 20 reads keys 13..20: blocks 3 on
    full, *sliding = tables(kv, "a")
    assert NULL_BLOCK not in full and len(full) == 6
    for table in sliding:
        assert table[:first_block_read(20)] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[3:]
    assert kv.block_pool.num_used_blocks == 6 + 2 * 3 and kv.num_window_freed_blocks == 2 * 3
    assert kv.get_block_ids("a", group=1)[:3] == [0, 0, 0]
    assert len({b.block_id for t in tables(kv, "a") for b in t if b is not NULL_BLOCK}) == 12, "no block shared"
    kv.check_consistency({"a"})
    kv.free(request)
    assert kv.block_pool.num_used_blocks == 0
    kv.check_consistency(set())


def test_demand_is_the_sum_over_groups():
    kv = KVCacheManager(num_blocks=8, block_size=BS, group_windows=WINDOWS)
    full_blocks = -(-101 // BS)
    assert kv.num_blocks_needed(100, 1) == full_blocks + 2 * (full_blocks - first_block_read(100))
    assert blocks_needed([None], 100, 1, BS) == full_blocks


def test_a_prefix_hit_is_the_length_every_group_has():
    """Both groups' blocks are cached under their own keys; a hit needs the full group's whole prefix and only the
    sliding groups' blocks inside the next query's window, the ones before it taken as placeholders."""
    kv = KVCacheManager(num_blocks=64, block_size=BS, group_windows=WINDOWS)
    tokens = list(range(100, 128))  # 7 full blocks
    first = make_request("a", tokens)
    compute(kv, first, 28)
    kv.free(first)
    hashes = first.block_hashes
    assert {kv.block_pool.lookup(group_key(hashes[0], g)) is not None for g in range(3)} == {True}
    assert len({kv.block_pool.lookup(group_key(hashes[6], g)).block_id for g in range(3)}) == 3
    second = make_request("b", tokens + [7, 8])
    computed = kv.get_computed_blocks(second)
    assert computed.num_blocks == 7  # the last token is always computed
    assert NULL_BLOCK not in computed.device
    for g in (1, 2):
        assert computed.group(g).device[:first_block_read(28)] == [NULL_BLOCK] * 5
    used = kv.block_pool.num_used_blocks
    assert kv.allocate_slots(second, 2, computed) and second.num_computed_tokens == 28
    assert kv.block_pool.num_used_blocks == used + 8 + 2 * 3  # 7 + 1 full, (2 in the window + 1) per sliding group
    kv.check_consistency({"b"})
    # A sliding group whose window blocks were evicted bounds the hit for every group.
    kv.free(second)
    for h in hashes[5:7]:
        kv.block_pool.cached.pop(group_key(h, 2)).block_hash = None
    third = make_request("c", tokens + [7, 8])
    assert kv.get_computed_blocks(third).num_blocks < 7
    kv.check_consistency(set())


def test_swap_and_fork_keep_every_group_exact():
    kv = KVCacheManager(num_blocks=32, block_size=BS, num_host_blocks=32, group_windows=WINDOWS)
    parent, child = make_request("p", 20), make_request("c", 20)
    compute(kv, parent, 21)
    kv.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.check_consistency({"p", "c"})
    compute(kv, child, 1)  # the shared partial last block of every group is copied on write
    assert len(kv.take_transfers().copies) == 3
    kv.check_consistency({"p", "c"})
    live = [b.block_id for t in tables(kv, "p") for b in t if b is not NULL_BLOCK]
    assert kv.can_swap_out(parent)
    kv.swap_out(parent)
    assert sorted(d for d, _ in kv.take_transfers().swap_out) == sorted(live)
    kv.finish_step()
    kv.check_consistency({"p", "c"})
    assert kv.allocate_slots(parent, 1)
    assert [len(t) for t in tables(kv, "p")] == [6, 6, 6]
    assert tables(kv, "p")[1][:3] == [NULL_BLOCK] * 3
    assert len(kv.take_transfers().swap_in) == len(live)
    kv.finish_step()
    kv.check_consistency({"p", "c"})
    kv.free(parent)
    kv.free(child)
    assert kv.block_pool.num_used_blocks == 0
    kv.check_consistency(set())


def test_check_consistency_catches_groups_that_disagree():
    kv = KVCacheManager(num_blocks=32, block_size=BS, group_windows=WINDOWS)
    request = make_request("a", 8)
    compute(kv, request, 8)
    kv.groups[2].req_to_blocks["a"].append(NULL_BLOCK)
    with pytest.raises(RuntimeError, match="disagree"):
        kv.check_consistency({"a"})


def test_the_dashboard_lists_each_groups_blocks():
    from pagellm.config import SchedulerConfig
    from pagellm.core.sched.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=32, block_size=BS, group_windows=WINDOWS)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), 128, kv)
    request = make_request("a", 20)
    scheduler.add_request(request)
    compute(kv, request, 20)
    compute(kv, request, 1)
    state = engine_state(scheduler)
    assert [g["window"] for g in state["kv_cache_groups"]] == WINDOWS
    assert [g["num_blocks"] for g in state["kv_cache_groups"]] == [6, 3, 3]
    assert [g["window_freed_blocks_total"] for g in state["kv_cache_groups"]] == [0, 3, 3]
