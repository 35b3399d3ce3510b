"""The KV cache manager with a sliding window shared by every layer: blocks wholly before the window of the next
query are freed and their table entries become placeholders (block id 0), the tables stay positional, and the
accounting stays exact (check_consistency) through prefix hits, forks and swapping. The expected blocks follow
from the window rule written out here: a query at position q reads keys q - W < k <= q."""
from __future__ import annotations

from scheduler_factories import compute, make_request

from pagellm.config import SchedulerConfig
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.kv.sliding_window import NULL_BLOCK
from pagellm.core.sched.scheduler import Scheduler
from pagellm.core.state_snapshot import request_state

BS, W = 4, 8


def first_block_read(num_computed: int) -> int:
    """The block holding the oldest key the query at position `num_computed` reads."""
    return max(0, num_computed - W + 1) // BS


def live_ids(kv: KVCacheManager, request_id: str) -> list[int]:
    return [b.block_id for b in kv.req_to_blocks[request_id] if b is not NULL_BLOCK]


def test_blocks_before_the_window_are_freed_and_the_table_stays_positional():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=W)
    request = make_request("a", 20)
    compute(kv, request, 20)
    assert kv.block_pool.num_used_blocks == 5  # nothing freed before the next query is known
    kv.take_rewritten_table("a")
    compute(kv, request, 1)  # the query at 20 reads keys 13..20: blocks 3 on
    table = kv.req_to_blocks["a"]
    assert len(table) == 6 and table[:first_block_read(20)] == [NULL_BLOCK] * 3
    assert all(b is not NULL_BLOCK for b in table[3:])
    assert kv.get_block_ids("a")[:3] == [0, 0, 0]
    assert kv.block_pool.num_used_blocks == 3 and kv.num_window_freed_blocks == 3
    assert kv.take_rewritten_table("a"), "the workers get the whole table again"
    assert kv.num_logical_blocks == 3
    kv.check_consistency({"a"})
    kv.free(request)
    assert kv.block_pool.num_used_blocks == 0
    kv.check_consistency(set())


def test_decoding_holds_only_the_window():
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=W)
    request = make_request("a", 4, max_tokens=200)
    compute(kv, request, 4)
    for _ in range(100):  # 104 tokens in an 8-block (32-token) pool
        compute(kv, request, 1)
        n = request.num_computed_tokens
        assert len(live_ids(kv, "a")) == -(-n // BS) - first_block_read(n - 1)
    kv.check_consistency({"a"})


def test_demand_counts_the_window_only():
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=W)
    assert kv.num_blocks_needed(100, 1) == 26 - first_block_read(100)
    assert kv.num_blocks_needed(0, 20) == 5
    full = KVCacheManager(num_blocks=8, block_size=BS)
    assert full.num_blocks_needed(100, 1) == 26


def test_freed_blocks_stay_cached_for_a_later_prefix_hit():
    kv = KVCacheManager(num_blocks=32, block_size=BS, sliding_window=W)
    tokens = list(range(100, 124))  # six full blocks
    first = make_request("a", tokens)
    compute(kv, first, 24)
    compute(kv, first, 1)
    second = make_request("b", tokens)
    computed = kv.get_computed_blocks(second)
    assert computed.num_blocks == 5  # the freed blocks of a are still cached
    assert kv.allocate_slots(second, 24 - 20, computed) and second.num_computed_tokens == 20
    # Only the blocks the query at 20 reads are held: the hits before them are released at once.
    assert kv.req_to_blocks["b"][:first_block_read(20)] == [NULL_BLOCK] * 3
    kv.check_consistency({"a", "b"})
    kv.free(first)
    kv.free(second)
    kv.check_consistency(set())


def test_forks_share_the_live_blocks_and_free_them_once_each():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=W)
    parent, child = make_request("p", 20), make_request("c", 20)
    compute(kv, parent, 20)
    compute(kv, parent, 1)
    kv.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    assert [b.ref_cnt for b in kv.req_to_blocks["p"][3:]] == [2, 2, 2]
    kv.check_consistency({"p", "c"})
    compute(kv, child, 1)  # writes into the shared last block: copied on write
    kv.check_consistency({"p", "c"})
    kv.free(parent)
    kv.free(child)
    assert kv.block_pool.num_used_blocks == 0
    kv.check_consistency(set())


def test_swap_copies_only_the_live_blocks_and_keeps_the_freed_entries():
    kv = KVCacheManager(num_blocks=16, block_size=BS, num_host_blocks=16, sliding_window=W)
    request = make_request("a", 20)
    compute(kv, request, 20)
    compute(kv, request, 1)
    live = live_ids(kv, "a")
    kv.take_transfers()
    assert kv.can_swap_out(request)
    kv.swap_out(request)
    assert [d for d, _ in kv.take_transfers().swap_out] == live
    kv.finish_step()
    assert kv.block_pool.num_used_blocks == 0
    kv.check_consistency({"a"})
    assert kv.allocate_slots(request, 1)
    table = kv.req_to_blocks["a"]
    assert len(table) == 6 and table[:3] == [NULL_BLOCK] * 3
    assert len(kv.take_transfers().swap_in) == 3
    kv.finish_step()
    kv.check_consistency({"a"})
    kv.free(request)
    kv.check_consistency(set())


def test_admission_counts_the_window_not_every_token():
    """100-token prompts in 16-token chunks: the last chunk writes blocks 21-24 and its first query (position 84)
    reads from key 77 (block 19) on, so a request needs 6 blocks at most; an 8-block pool admits one at a time
    where full attention (25 blocks each) admits none."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16)
    windowed = Scheduler(config, 128, KVCacheManager(8, BS, sliding_window=W))
    full = Scheduler(config, 128, KVCacheManager(8, BS))
    assert first_block_read(84) == 19 and (100 - 1) // BS - first_block_read(84) + 1 == 6
    assert windowed.num_fitting([(1, 100)] * 3) == 1
    assert windowed.num_fitting([(1, 100)] * 3, free_blocks=12) == 2
    assert full.num_fitting([(1, 100)] * 3) == 0


def test_dashboard_snapshot_lists_live_blocks_and_counts_the_freed():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=W)
    request = make_request("a", 20)
    compute(kv, request, 20)
    compute(kv, request, 1)
    state = request_state(request, kv)
    assert state["blocks"] == live_ids(kv, "a") and len(state["blocks"]) == 3
    assert state["num_window_freed_blocks"] == first_block_read(20)


def test_a_prefix_hit_needs_only_the_blocks_inside_the_window():
    """The head of a cached prefix is evicted; a request with the same 26 tokens still reuses the prefix whose next
    query's window is cached: 24 tokens, the query at 24 reading keys 17-24 (blocks 4 and 5)."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=W)
    tokens = list(range(100, 126))
    first = make_request("a", tokens)
    compute(kv, first, 26)
    kv.free(first)
    for block_hash in first.block_hashes[:3]:  # evict the three head blocks
        kv.block_pool.cached.pop(block_hash).block_hash = None
    second = make_request("b", tokens)
    computed = kv.get_computed_blocks(second)
    assert computed.num_blocks == 6 and computed.device[:first_block_read(24)] == [NULL_BLOCK] * 4
    assert kv.allocate_slots(second, 2, computed) and second.num_computed_tokens == 24
    kv.check_consistency({"b"})
    assert kv.block_pool.num_used_blocks == 3  # blocks 4, 5 and the new one for tokens 24-25
    full = KVCacheManager(num_blocks=8, block_size=BS)
    compute(full, third := make_request("c", tokens), 26)
    full.free(third)
    full.block_pool.cached.pop(third.block_hashes[0]).block_hash = None
    assert full.get_computed_blocks(make_request("d", tokens)).num_blocks == 0, "full attention needs the head"
