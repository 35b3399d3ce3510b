"""BlockPool (ids, ref counts, free-list order) and KVCacheManager (block tables grown on demand)."""
from __future__ import annotations

import pytest
from scheduler_factories import make_request

from pagellm.core.kv.block_pool import BlockPool
from pagellm.core.kv.kv_cache_manager import KVCacheManager, cdiv

# Double free is currently reported with `assert`; accept the usual exception types so that switching to an
# explicit raise (which would survive `python -O`) does not break this test.
DOUBLE_FREE_ERRORS = RuntimeError


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_list(pool: BlockPool) -> list[int]:
    """Free block ids in the order allocate() hands them out: never-used blocks, then the free queue."""
    return list(range(len(pool.blocks), pool.num_blocks)) + [block.block_id for block in pool.free_queue]


# ---- BlockPool -----------------------------------------------------------------------------------------------
class TestBlockPool:
    def test_fresh_pool_is_all_free(self):
        pool = BlockPool(6)
        assert pool.num_blocks == 6
        assert pool.num_free_blocks == 6
        assert pool.num_used_blocks == 0
        assert pool.blocks == []  # block objects are created on first use
        assert free_list(pool) == list(range(6))

    def test_never_used_blocks_go_before_cached_ones(self):
        pool = BlockPool(4)
        (block,) = pool.allocate(1)
        pool.cache(block, b"h")
        pool.free([block])
        assert ids(pool.allocate(3)) == [1, 2, 3] and pool.lookup(b"h") is block
        assert ids(pool.allocate(1)) == [0] and pool.lookup(b"h") is None and block.block_hash is None

    @pytest.mark.parametrize("num_blocks", [0, -1])
    def test_empty_pool_rejected(self, num_blocks):
        with pytest.raises(ValueError, match="at least one block"):
            BlockPool(num_blocks)

    def test_allocate_hands_out_distinct_blocks_in_id_order_with_ref_one(self):
        pool = BlockPool(5)
        a = pool.allocate(2)
        b = pool.allocate(3)
        assert ids(a) == [0, 1]
        assert ids(b) == [2, 3, 4]
        assert all(block.ref_cnt == 1 for block in a + b)
        assert pool.num_free_blocks == 0
        assert pool.num_used_blocks == 5
        # The pool hands out its own block objects, so ref counts are visible through pool.blocks.
        assert all(pool.blocks[block.block_id] is block for block in a + b)

    def test_allocate_zero_is_a_no_op(self):
        pool = BlockPool(3)
        assert pool.allocate(0) == []
        assert pool.num_free_blocks == 3

    def test_over_allocation_raises_and_allocates_nothing(self):
        pool = BlockPool(4)
        pool.allocate(3)
        before = free_list(pool)
        with pytest.raises(RuntimeError, match="only 1 are free"):
            pool.allocate(2)
        assert free_list(pool) == before
        assert pool.num_free_blocks == 1
        # Asking for exactly what is left still works.
        assert ids(pool.allocate(1)) == [3]
        with pytest.raises(RuntimeError):
            pool.allocate(1)

    def test_free_returns_blocks_and_zeroes_ref_counts(self):
        pool = BlockPool(4)
        blocks = pool.allocate(3)
        pool.free(blocks)
        assert pool.num_free_blocks == 4
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert sorted(free_list(pool)) == [0, 1, 2, 3]

    def test_free_list_order_tail_blocks_reused_before_head(self):
        """The docstring: blocks are freed in reverse so a sequence's tail is reused first and its head stays
        warm longer. The free list is FIFO (allocate from the front, freed blocks go to the back)."""
        pool = BlockPool(8)
        table = pool.allocate(3)  # 0, 1, 2
        assert free_list(pool) == [3, 4, 5, 6, 7]
        pool.free(table)
        # Freed blocks queue up behind blocks that were already free, tail first.
        assert free_list(pool) == [3, 4, 5, 6, 7, 2, 1, 0]
        assert ids(pool.allocate(5)) == [3, 4, 5, 6, 7]
        assert ids(pool.allocate(1)) == [2]  # the old tail comes back first ...
        assert ids(pool.allocate(2)) == [1, 0]  # ... the old head last

    def test_full_pool_free_then_reallocate_reverses_the_table(self):
        pool = BlockPool(4)
        table = pool.allocate(4)
        pool.free(table)
        assert ids(pool.allocate(4)) == [3, 2, 1, 0]

    def test_share_adds_a_reference_and_block_stays_used_until_last_free(self):
        pool = BlockPool(4)
        table = pool.allocate(2)
        pool.touch(table)
        assert [b.ref_cnt for b in table] == [2, 2]
        pool.touch(table[:1])
        assert [b.ref_cnt for b in table] == [3, 2]

        pool.free(table)  # first holder lets go
        assert [b.ref_cnt for b in table] == [2, 1]
        assert pool.num_free_blocks == 2
        pool.free(table)
        assert [b.ref_cnt for b in table] == [1, 0]
        assert free_list(pool) == [2, 3, 1]
        assert pool.num_free_blocks == 3
        pool.free(table[:1])
        assert table[0].ref_cnt == 0
        assert free_list(pool) == [2, 3, 1, 0]
        assert pool.num_free_blocks == 4

    def test_touching_a_free_block_takes_it_out_of_the_middle_of_the_free_queue(self):
        pool = BlockPool(4)
        pool.free(pool.allocate(4)[::-1])  # free queue: 0, 1, 2, 3
        pool.touch([pool.blocks[2]])
        assert pool.blocks[2].ref_cnt == 1 and free_list(pool) == [0, 1, 3] and pool.num_free_blocks == 3
        pool.free([pool.blocks[2]])
        assert free_list(pool) == [0, 1, 3, 2]

    def test_double_free_is_an_error(self):
        pool = BlockPool(3)
        table = pool.allocate(2)
        pool.free(table)
        with pytest.raises(DOUBLE_FREE_ERRORS):
            pool.free(table)
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert sorted(free_list(pool)) == [0, 1, 2]  # no block queued twice

    def test_freeing_the_same_block_twice_in_one_call_is_an_error(self):
        pool = BlockPool(3)
        (block,) = pool.allocate(1)
        with pytest.raises(DOUBLE_FREE_ERRORS):
            pool.free([block, block])
        assert block.ref_cnt == 1  # checked before anything is released
        assert free_list(pool) == [1, 2]

    def test_freeing_a_free_block_is_an_error(self):
        pool = BlockPool(2)
        pool.free(pool.allocate(1))
        with pytest.raises(DOUBLE_FREE_ERRORS):
            pool.free([pool.blocks[0]])
        assert free_list(pool) == [1, 0]


# ---- KVCacheManager ------------------------------------------------------------------------------------------
class TestKVCacheManager:
    def test_cdiv(self):
        assert [cdiv(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
        assert cdiv(7, 1) == 7

    def test_num_blocks_for_tokens(self):
        kv = KVCacheManager(num_blocks=10, block_size=4)
        assert kv.num_blocks == 10
        assert [kv.num_blocks_for_tokens(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]

    def test_prefill_allocates_cdiv_blocks(self):
        kv = KVCacheManager(num_blocks=10, block_size=4)
        req = make_request("r0", 9)
        assert kv.allocate_slots(req, 9)
        assert kv.get_block_ids("r0") == [0, 1, 2]
        assert kv.block_pool.num_free_blocks == 7
        assert kv.block_pool.num_used_blocks == 3

    @pytest.mark.parametrize("block_size", [1, 2, 4, 16])
    def test_growth_is_exactly_the_missing_blocks(self, block_size):
        """Each call grows the table by cdiv(num_computed + new, block_size) - held, never shrinks it."""
        kv = KVCacheManager(num_blocks=64, block_size=block_size)
        req = make_request("r0", 5)
        steps = [5, 1, 1, 1, 3, 0, 7, 1, 1, 2]
        for new in steps:
            held = len(kv.get_block_ids("r0"))
            free_before = kv.block_pool.num_free_blocks
            assert kv.allocate_slots(req, new)
            want = max(held, cdiv(req.num_computed_tokens + new, block_size))
            assert len(kv.get_block_ids("r0")) == want
            assert free_before - kv.block_pool.num_free_blocks == want - held
            # The old table is a prefix of the new one: blocks never move.
            req.num_computed_tokens += new
        assert kv.get_block_ids("r0") == list(range(cdiv(sum(steps), block_size)))

    def test_allocate_slots_does_not_shrink(self):
        kv = KVCacheManager(num_blocks=8, block_size=4)
        req = make_request("r0", 5)
        assert kv.allocate_slots(req, 12)
        assert len(kv.get_block_ids("r0")) == 3
        assert kv.allocate_slots(req, 1)
        assert len(kv.get_block_ids("r0")) == 3
        assert kv.block_pool.num_free_blocks == 5

    def test_decode_into_partial_block_needs_no_new_block(self):
        kv = KVCacheManager(num_blocks=8, block_size=4)
        req = make_request("r0", 5)
        assert kv.allocate_slots(req, 5)
        req.num_computed_tokens = 5
        for _ in range(3):  # positions 5, 6, 7 fit the second block
            assert kv.allocate_slots(req, 1)
            req.num_computed_tokens += 1
            assert kv.get_block_ids("r0") == [0, 1]
        assert kv.allocate_slots(req, 1)  # position 8 opens a third block
        assert kv.get_block_ids("r0") == [0, 1, 2]

    def test_short_pool_returns_false_and_allocates_nothing(self):
        kv = KVCacheManager(num_blocks=4, block_size=4)
        a, b = make_request("a", 5), make_request("b", 5)
        assert kv.allocate_slots(a, 8)  # 2 blocks
        assert kv.allocate_slots(b, 4)  # 1 block; 1 left
        b.num_computed_tokens = 4
        free_ids = free_list(kv.block_pool)

        assert not kv.allocate_slots(b, 9)  # needs 3 more, 1 free
        assert kv.get_block_ids("b") == [2]
        assert free_list(kv.block_pool) == free_ids
        assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [1, 1, 1]  # block 3 never used yet

        c = make_request("c", 5)
        assert not kv.allocate_slots(c, 5)  # needs 2, 1 free
        assert kv.get_block_ids("c") == []
        assert kv.req_to_blocks.get("c", []) == []
        assert free_list(kv.block_pool) == free_ids

        assert kv.allocate_slots(c, 4)  # exactly the last block
        assert kv.get_block_ids("c") == [3]
        assert kv.block_pool.num_free_blocks == 0
        assert not kv.allocate_slots(c, 5)
        assert kv.get_block_ids("c") == [3]

    def test_free_returns_blocks_and_forgets_request(self):
        kv = KVCacheManager(num_blocks=6, block_size=2)
        a, b = make_request("a", 5), make_request("b", 5)
        assert kv.allocate_slots(a, 5)
        assert kv.allocate_slots(b, 2)
        kv.free(a)
        assert "a" not in kv.req_to_blocks
        assert kv.get_block_ids("a") == []
        assert kv.block_pool.num_free_blocks == 5
        assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [0, 0, 0, 1]  # blocks 4, 5 never used
        # a's tail block comes back before its head, after the blocks that were already free.
        assert free_list(kv.block_pool) == [4, 5, 2, 1, 0]
        kv.free(b)
        assert kv.req_to_blocks == {}
        assert kv.block_pool.num_free_blocks == 6

    def test_free_of_unknown_or_already_freed_request_is_harmless(self):
        kv = KVCacheManager(num_blocks=3, block_size=2)
        req = make_request("r0", 5)
        kv.free(req)  # never allocated
        assert kv.allocate_slots(req, 3)
        kv.free(req)
        kv.free(req)  # second free: the table is gone, so nothing is freed twice
        assert kv.block_pool.num_free_blocks == 3
        assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)

    def test_reallocation_after_free_starts_a_fresh_table(self):
        kv = KVCacheManager(num_blocks=4, block_size=4)
        req = make_request("r0", 6)
        assert kv.allocate_slots(req, 6)
        req.num_computed_tokens = 6
        kv.free(req)
        req.num_computed_tokens = 0  # what recompute preemption does
        assert kv.allocate_slots(req, 7)
        assert len(kv.get_block_ids("r0")) == 2
        assert kv.block_pool.num_free_blocks == 2
