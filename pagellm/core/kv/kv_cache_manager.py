"""Block tables over a two-tier memory: which physical blocks hold each request's K/V, grown on demand, shared
between forked sequences (n > 1, beam search) and copied on write, reused across requests through the prefix
cache, and moved to and from host memory.

Prefix cache (see prefix_cache.py): a new request takes every cached block of its prefix and computes only the rest.

Host tier (see host_tier.py, which owns both pools and the step's block moves): evicted cached blocks are kept
in host memory for later prefix hits, and a request preempted by swapping has its blocks copied out and back in.

KV cache groups (see kv_cache_groups.py): a request holds one block table per group, all over the one pool and all
positional (every table has an entry per block of the request's tokens). A full-attention group keeps every block.
A sliding group (window W) frees a block once the request has computed past its window (a query at position q
reads keys q - W < k <= q): its entry becomes `NULL_BLOCK` (block id 0 for the workers, read only under the
kernels' window mask), and the freed block stays cached for prefix hits until evicted. `req_to_blocks` and
`req_to_host_blocks` are the first group's tables (a full-attention group when the model has one).
"""
from __future__ import annotations

from pagellm.core.kv.block_pool import BlockPool, KVCacheBlock
from pagellm.core.kv.group_tables import GroupTables, check_tables, device_holders, host_holders, token_efficiency
from pagellm.core.kv.host_tier import TieredBlocks, Transfers
from pagellm.core.kv.kv_cache_groups import blocks_needed, cdiv
from pagellm.core.kv.prefix_cache import PrefixCache, PrefixCacheStats
from pagellm.core.kv.prefix_hit import ComputedBlocks
from pagellm.core.kv.sliding_window import NULL_BLOCK, live, num_skipped_blocks
from pagellm.core.request import Request

__all__ = ["ComputedBlocks", "KVCacheManager", "Transfers", "cdiv"]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, sliding_window: int | None = None,
                 group_windows: list[int | None] | None = None) -> None:
        """`group_windows`: each KV cache group's sliding window (None: full attention); by default one group of
        `sliding_window`."""
        self.block_size = block_size
        self.groups = [GroupTables(window) for window in (group_windows or [sliding_window])]
        self.group_windows = [group.window for group in self.groups]
        # The window every layer shares (None: some layer attends to all tokens, or the groups differ).
        self.sliding_window = self.group_windows[0] if len(self.groups) == 1 else None
        self.tiers = TieredBlocks(num_blocks, num_host_blocks)
        self.block_pool: BlockPool = self.tiers.device
        self.host_pool: BlockPool | None = self.tiers.host
        self.req_to_blocks = self.groups[0].req_to_blocks
        self.req_to_host_blocks = self.groups[0].req_to_host_blocks  # requests swapped out to the host tier
        self._rewritten_tables: set[str] = set()  # tables with a block replaced in place (copy-on-write)
        self.prefix_cache = PrefixCache(self.groups, block_size, self.block_pool, self.host_pool,
                                        enable_prefix_caching)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache.enabled

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        return self.prefix_cache.stats

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_swapped_out_blocks(self) -> int:
        """Cumulative: blocks copied to the host tier (swap preemption and evicted cached blocks)."""
        return self.tiers.num_swapped_out_blocks

    @property
    def num_swapped_in_blocks(self) -> int:
        """Cumulative: blocks copied back from the host tier (swapped requests and host prefix hits)."""
        return self.tiers.num_swapped_in_blocks

    @property
    def _held_host_blocks(self) -> list[KVCacheBlock]:
        """The host blocks this step's copies hold (tests/core/test_scheduler_invariants.py counts them)."""
        return self.tiers.held_host_blocks

    @property
    def num_window_freed_blocks(self) -> int:
        """Cumulative, every group: blocks freed because they fell out of a sliding window."""
        return sum(group.num_window_freed_blocks for group in self.groups)

    @property
    def num_logical_blocks(self) -> int:
        """Blocks the live block tables would hold if nothing were shared."""
        return sum(len(live(blocks)) for group in self.groups for blocks in group.req_to_blocks.values())

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Entries of one block table covering `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_blocks_needed(self, num_computed: int, num_new: int) -> int:
        """Blocks a request holds while computing `num_new` tokens after `num_computed`, every group's: a sliding
        group's window only, not all."""
        return blocks_needed(self.group_windows, num_computed, num_new, self.block_size)

    def _free_skipped_blocks(self, group: GroupTables, request_id: str, num_computed: int) -> None:
        """Free the blocks that fell out of the group's window, keeping the table positional."""
        blocks = group.req_to_blocks.get(request_id)
        skip = min(num_skipped_blocks(num_computed, group.window, self.block_size), len(blocks or ()))
        if not blocks or skip == 0 or blocks[skip - 1] is NULL_BLOCK:
            return
        dropped = live(blocks[:skip])
        blocks[:skip] = [NULL_BLOCK] * skip
        self.block_pool.free(dropped)
        group.num_window_freed_blocks += len(dropped)
        self._rewritten_tables.add(request_id)

    # ---- prefix cache ---------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The request's longest cached prefix (see PrefixCache); `allocate_slots` takes the blocks."""
        return self.prefix_cache.get_computed_blocks(request)

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks whose K/V are now all computed (called after each step that ran it)."""
        self.prefix_cache.cache_full_blocks(request)

    def record_query(self, request: Request) -> None:
        """Count a request's admission as a prefix-cache query (see PrefixCache)."""
        self.prefix_cache.record_query(request)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds (after a failed step, whose copies may not have happened)."""
        self.tiers.reset_cache()

    # ---- allocation -----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None) -> bool:
        """Make room for `num_new_tokens` more K/V entries after the request's computed tokens, in every group,
        taking first the cached prefix blocks `computed` (for a request with no blocks yet) or swapping its blocks
        back in (a request preempted by swapping); `request.num_computed_tokens` then moves past the blocks taken.

        The first slot written may lie in a partly filled block another sequence also holds (after a fork): that
        block is copied on write, so the other holders keep their K/V. Returns False, changing nothing, when the
        pool is too small right now for every group (the caller may preempt).
        """
        request_id = request.request_id
        computed = computed or ComputedBlocks()
        for group in self.groups:
            self._free_skipped_blocks(group, request_id, request.num_computed_tokens)
        num_hit = len(computed.device) + len(computed.host)  # every group's hit has this length
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        first = num_computed // self.block_size
        num_entries = cdiv(num_computed + num_new_tokens, self.block_size)
        plans, needed, free = [], 0, self.block_pool.num_free_blocks
        for g, group in enumerate(self.groups):
            hit = computed.group(g)
            blocks = group.req_to_blocks.get(request_id, [])
            swapped = group.req_to_host_blocks.get(request_id, [])
            copy_on_write = (num_new_tokens > 0 and first < len(blocks) and blocks[first] is not NULL_BLOCK
                             and blocks[first].ref_cnt > 1)
            num_held = len(blocks) + num_hit + len(swapped) + group.swapped_num_freed.get(request_id, 0)
            num_fresh = max(num_entries - num_held, 0)
            needed += num_fresh + copy_on_write + len(hit.host) + len(swapped)
            if hit.device:  # cached hits nobody holds are counted as free, but taking them makes them unavailable
                free -= sum(block.ref_cnt == 0 for block in live(hit.device))
            plans.append((hit, copy_on_write, num_fresh))
        if needed > free:
            return False

        if num_hit:
            self.prefix_cache.record_hit(request, num_hit * self.block_size)
            # Every group's hits are taken before any group allocates: an allocation evicts cached blocks nobody
            # holds (on the device, and in the host tier, where evicted device blocks are saved). Host hits are held
            # until the step has copied them in.
            for hit, _, _ in plans:
                self.block_pool.touch(live(hit.device))
                if hit.host and self.host_pool is not None:
                    self.host_pool.touch(hit.host)
        swapped_in = False
        for group, (hit, copy_on_write, num_fresh) in zip(self.groups, plans):
            swapped_in |= self._grow(group, request_id, hit, copy_on_write, num_fresh, first)
        if num_hit or swapped_in:
            # Blocks that arrived whole are indexed now: their K/V are in place before the forward pass reads them.
            request.num_computed_tokens = num_computed
            self.cache_full_blocks(request)
            for group in self.groups:
                self._free_skipped_blocks(group, request_id, num_computed)
        return True

    def _grow(self, group: GroupTables, request_id: str, hit: ComputedBlocks, copy_on_write: bool, num_fresh: int,
              first: int) -> bool:
        """One group's part of `allocate_slots`, once the pool is known to have room and the hits are taken. True when
        it swapped in."""
        blocks = group.req_to_blocks.get(request_id, [])
        if hit.device:
            blocks = blocks + hit.device
        if hit.host:
            blocks += self.tiers.load_from_host(hit.host)
        swapped = request_id in group.req_to_host_blocks
        if swapped:
            blocks += [NULL_BLOCK] * group.swapped_num_freed.pop(request_id, 0)
            blocks += self.tiers.load_from_host(group.req_to_host_blocks.pop(request_id))
        if copy_on_write:
            blocks[first] = self.tiers.copy_on_write(blocks[first])
            self._rewritten_tables.add(request_id)
        group.req_to_blocks[request_id] = blocks + self.block_pool.allocate(num_fresh)
        return swapped

    def can_swap_out(self, request: Request) -> bool:
        num = sum(len(live(group.req_to_blocks.get(request.request_id, []))) for group in self.groups)
        return self.host_pool is not None and 0 < num <= self.host_pool.num_free_blocks

    def swap_out(self, request: Request) -> None:
        """Preemption by swapping: copy the request's blocks (every group's) to host blocks it holds until it
        resumes, and free its device blocks (cached ones stay cached). Entries freed by a window stay freed."""
        request_id = request.request_id
        for group in self.groups:
            table = group.req_to_blocks.pop(request_id)
            blocks = live(table)
            if len(blocks) < len(table):
                group.swapped_num_freed[request_id] = len(table) - len(blocks)
            group.req_to_host_blocks[request_id] = self.tiers.copy_to_host(blocks)
            group.num_cached_blocks.pop(request_id, None)
            self.block_pool.free(blocks)

    def is_swapped_out(self, request: Request) -> bool:
        return request.request_id in self.req_to_host_blocks

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block tables, sharing every block (the child has the same tokens)."""
        for group in self.groups:
            blocks = group.req_to_blocks.get(parent.request_id, [])
            self.block_pool.touch(live(blocks))
            group.req_to_blocks[child.request_id] = list(blocks)
            group.num_cached_blocks[child.request_id] = group.num_cached_blocks.get(parent.request_id, 0)

    def take_transfers(self) -> Transfers:
        """The block moves this step owes the workers (see host_tier.py)."""
        return self.tiers.take_transfers()

    def finish_step(self) -> None:
        """The step's copies are done: release the host blocks they held."""
        self.tiers.finish_step()

    def get_block_ids(self, request_id: str, start: int = 0, group: int = 0) -> list[int]:
        """Block ids of one group's table (by default the first), from entry `start` on."""
        return [block.block_id for block in self.groups[group].req_to_blocks.get(request_id, ())[start:]]

    def take_rewritten_table(self, request_id: str) -> bool:
        """Whether a block of the request's tables was replaced in place (copy-on-write, or freed by a window)
        since the last call."""
        if request_id in self._rewritten_tables:
            self._rewritten_tables.discard(request_id)
            return True
        return False

    def free(self, request: Request) -> None:
        """Release everything the request holds, in either tier and every group."""
        request_id = request.request_id
        self._rewritten_tables.discard(request_id)
        for group in self.groups:
            group.num_cached_blocks.pop(request_id, None)
            group.swapped_num_freed.pop(request_id, None)
            blocks = live(group.req_to_blocks.pop(request_id, []))
            if blocks:
                self.block_pool.free(blocks)
            host_blocks = group.req_to_host_blocks.pop(request_id, None)
            if host_blocks and self.host_pool is not None:
                self.host_pool.free(host_blocks)

    def token_efficiency(self, num_computed: dict[str, int]) -> float:
        """Tokens stored / capacity of the blocks requests hold (see group_tables.token_efficiency)."""
        return token_efficiency(self.groups, num_computed, self.block_size, self.block_pool.num_used_blocks)

    def check_consistency(self, live_request_ids: set[str]) -> None:
        """Raise RuntimeError unless only live requests hold blocks, every group holds the same requests with tables
        of the same length, and every block's ref count equals the number of holders, in both tiers (checked after a
        failed step, before the engine goes on)."""
        check_tables(self.groups, live_request_ids)
        self.block_pool.check_ref_counts(device_holders(self.groups))
        self.tiers.check_host_ref_counts(host_holders(self.groups))
