"""Block tables over a two-tier memory: which physical blocks hold each request's K/V, grown on demand, shared
between forked sequences (n > 1, beam search) and copied on write, reused across requests through the prefix
cache, and moved to and from host memory.

Prefix cache: once a full block's K/V are computed it is indexed under its chained hash (see block_hash.py). A new
request takes every cached block of its prefix and computes only the rest. Freed blocks stay cached until the
pool needs them (see BlockPool).

Host tier (when it has blocks): a second BlockPool whose blocks mirror device blocks in host memory. A cached
device block that is evicted is copied to a host block first, keeping its hash, and a later prefix hit on it is
copied back instead of recomputed; a request preempted by swapping has all its blocks copied out and back in.
The copies are only listed here (`take_transfers`); the workers make them before the step's forward pass. Host
blocks a step's copies read or write are held until the step has run (`finish_step`), so no later decision in the
same step can reuse them.

Sliding window (`sliding_window`, when every layer attends within the same window W, as Mistral's do): a query at
position q reads keys q - W < k <= q, so once a request has computed past a block's window the block is freed and
its table entry becomes `NULL_BLOCK` (block id 0 for the workers, read only under the kernels' window mask; the
entries stay positional). The freed blocks stay cached for prefix hits until evicted.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagellm.core.kv.block_hash import extend_block_hashes
from pagellm.core.kv.block_pool import BlockPool, KVCacheBlock
from pagellm.core.kv.sliding_window import NULL_BLOCK, live, num_skipped_blocks, window_hit
from pagellm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class ComputedBlocks:
    """A request's prefix found in the cache: blocks on the device, then blocks only the host tier still has."""

    device: list[KVCacheBlock] = field(default_factory=list)
    host: list[KVCacheBlock] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.host)


@dataclass(slots=True)
class Transfers:
    """The block moves one step owes the workers, in the order they are made (see SchedulerOutput)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device source, device destination)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative, in tokens. A preempted request finding its own blocks again is counted apart."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's window (None: some layer attends to all tokens)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, on_evict=self._save_to_host if num_host_blocks else None)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_host_blocks: dict[str, list[KVCacheBlock]] = {}  # requests swapped out to the host tier
        self._swapped_num_freed: dict[str, int] = {}  # a swapped-out table's leading NULL_BLOCK entries
        self.num_window_freed_blocks = 0  # cumulative: blocks freed because they fell out of the window
        self._num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are indexed
        self._transfers = Transfers()
        self._held_host_blocks: list[KVCacheBlock] = []  # read or written by this step's copies
        self._rewritten_tables: set[str] = set()  # tables with a block replaced in place (copy-on-write)
        self.prefix_stats = PrefixCacheStats()
        # Blocks copied to and from the host tier (swap preemption and the second-level prefix cache).
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_logical_blocks(self) -> int:
        """Blocks the live block tables would hold if nothing were shared."""
        return sum(len(live(blocks)) for blocks in self.req_to_blocks.values())

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_skipped_blocks(self, num_computed: int) -> int:
        return num_skipped_blocks(num_computed, self.sliding_window, self.block_size)

    def num_blocks_needed(self, num_computed: int, num_new: int) -> int:
        """Blocks a request holds while computing `num_new` tokens after `num_computed`: its window's, not all."""
        return self.num_blocks_for_tokens(num_computed + num_new) - self.num_skipped_blocks(num_computed)

    def _free_skipped_blocks(self, request_id: str, num_computed: int) -> None:
        """Free the blocks that fell out of the window, keeping the table positional."""
        blocks = self.req_to_blocks.get(request_id)
        skip = min(self.num_skipped_blocks(num_computed), len(blocks or ()))
        if not blocks or skip == 0 or blocks[skip - 1] is NULL_BLOCK:
            return
        dropped = live(blocks[:skip])
        blocks[:skip] = [NULL_BLOCK] * skip
        self.block_pool.free(dropped)
        self.num_window_freed_blocks += len(dropped)
        self._rewritten_tables.add(request_id)

    # ---- prefix cache ---------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of the request's tokens, in whole blocks, leaving at least its last token to
        compute (its logits are needed). Changes nothing; `allocate_slots` takes the blocks."""
        computed = ComputedBlocks()
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return computed  # cached positions have no logits or hidden states to report
        hashes = self._block_hashes(request)
        for block_hash in hashes[:(request.num_tokens - 1) // self.block_size]:
            block = None if computed.host else self.block_pool.lookup(block_hash)
            if block is not None:
                computed.device.append(block)
                continue
            block = self.host_pool.lookup(block_hash) if self.host_pool is not None else None
            if block is None:
                break
            computed.host.append(block)
        if self.sliding_window is not None:
            windowed = window_hit(self.block_pool, hashes[:(request.num_tokens - 1) // self.block_size],
                                  self.sliding_window, self.block_size)
            if len(windowed) > computed.num_blocks:
                return ComputedBlocks(device=windowed)
        return computed

    def _block_hashes(self, request: Request) -> list[bytes]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
                            request.lora_request.lora_int_id if request.lora_request else None)
        return request.block_hashes

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks whose K/V are now all computed (called after each step that ran it)."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for index in range(start, num_full):
            if blocks[index] is not NULL_BLOCK:
                self.block_pool.cache(blocks[index], hashes[index])
        self._num_cached_blocks[request.request_id] = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds (after a failed step, whose copies may not have happened)."""
        self.finish_step()
        self.block_pool.reset_cache()
        if self.host_pool is not None:
            self.host_pool.reset_cache()

    # ---- allocation -----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None) -> bool:
        """Make room for `num_new_tokens` more K/V entries after the request's computed tokens, taking first the
        cached prefix blocks `computed` (for a request with no blocks yet) or swapping its blocks back in (a
        request preempted by swapping); `request.num_computed_tokens` then moves past the blocks taken.

        The first slot written may lie in a partly filled block another sequence also holds (after a fork): that
        block is copied on write, so the other holders keep their K/V. Returns False, changing nothing, when the
        pool is too small right now (the caller may preempt).
        """
        request_id = request.request_id
        computed = computed or ComputedBlocks()
        self._free_skipped_blocks(request_id, request.num_computed_tokens)
        blocks = self.req_to_blocks.get(request_id, [])
        swapped = self.req_to_host_blocks.get(request_id, [])
        num_swapped_freed = self._swapped_num_freed.get(request_id, 0)
        num_computed = request.num_computed_tokens + computed.num_blocks * self.block_size
        first = num_computed // self.block_size
        copy_on_write = (num_new_tokens > 0 and first < len(blocks) and blocks[first] is not NULL_BLOCK
                         and blocks[first].ref_cnt > 1)
        num_held = len(blocks) + computed.num_blocks + len(swapped) + num_swapped_freed
        num_fresh = max(self.num_blocks_for_tokens(num_computed + num_new_tokens) - num_held, 0)
        # Cached hits nobody holds are counted as free, but taking them makes them unavailable.
        free = self.block_pool.num_free_blocks - sum(block.ref_cnt == 0 for block in live(computed.device))
        if num_fresh + copy_on_write + len(computed.host) + len(swapped) > free:
            return False

        if computed.num_blocks:
            self._record_hit(request, computed.num_blocks * self.block_size)
        self.block_pool.touch(live(computed.device))
        blocks = blocks + computed.device
        if computed.host:
            blocks += self._load_from_host(computed.host, release=False)
        if swapped or num_swapped_freed:
            blocks += [NULL_BLOCK] * self._swapped_num_freed.pop(request_id, 0)
            blocks += self._load_from_host(self.req_to_host_blocks.pop(request_id), release=True)
        if copy_on_write:
            shared = blocks[first]
            (private,) = self.block_pool.allocate(1)
            self.block_pool.free([shared])
            blocks[first] = private
            self._transfers.copies.append((shared.block_id, private.block_id))
            self._rewritten_tables.add(request_id)
        self.req_to_blocks[request_id] = blocks + self.block_pool.allocate(num_fresh)
        if computed.num_blocks or swapped:
            # Blocks that arrived whole are indexed now: their K/V are in place before the forward pass reads them.
            request.num_computed_tokens = num_computed
            self.cache_full_blocks(request)
            self._free_skipped_blocks(request_id, num_computed)
        return True

    def _record_hit(self, request: Request, num_tokens: int) -> None:
        if request.num_preemptions:
            self.prefix_stats.preempted_hits += num_tokens
        else:
            self.prefix_stats.hits += num_tokens

    def record_query(self, request: Request) -> None:
        """Count a request's admission as a prefix-cache query of all its tokens (vLLM's convention, although the
        last one is always computed)."""
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return
        if request.num_preemptions:
            self.prefix_stats.preempted_queries += request.num_tokens
        else:
            self.prefix_stats.queries += request.num_tokens

    def _load_from_host(self, host_blocks: list[KVCacheBlock], release: bool) -> list[KVCacheBlock]:
        """Fresh device blocks receiving copies of `host_blocks` this step. The host blocks are held until the step
        is over; `release` drops the caller's own reference to them then (a swapped-out request's blocks)."""
        if not release:
            # Held before the device allocation below, whose evictions take host blocks.
            self.host_pool.touch(host_blocks)
        self._held_host_blocks += host_blocks
        device_blocks = self.block_pool.allocate(len(host_blocks))
        self._transfers.swap_in += [(h.block_id, d.block_id) for h, d in zip(host_blocks, device_blocks)]
        self.num_swapped_in_blocks += len(host_blocks)
        return device_blocks

    def _save_to_host(self, block: KVCacheBlock) -> None:
        """Eviction hook of the device pool: keep a copy of the cached block in the host tier when a host block is
        free (the host tier evicts its own least recently used copy for it)."""
        if block.block_hash in self.host_pool.cached or not self.host_pool.num_free_blocks:
            return
        (host_block,) = self.host_pool.allocate(1)
        self.host_pool.cache(host_block, block.block_hash)
        self._transfers.swap_out.append((block.block_id, host_block.block_id))
        self._held_host_blocks.append(host_block)
        self.num_swapped_out_blocks += 1

    def can_swap_out(self, request: Request) -> bool:
        blocks = live(self.req_to_blocks.get(request.request_id, []))
        return self.host_pool is not None and 0 < len(blocks) <= self.host_pool.num_free_blocks

    def swap_out(self, request: Request) -> None:
        """Preemption by swapping: copy the request's blocks to host blocks it holds until it resumes, and free its
        device blocks (cached ones stay cached). Entries freed by the window stay freed."""
        table = self.req_to_blocks.pop(request.request_id)
        blocks = live(table)
        if len(blocks) < len(table):
            self._swapped_num_freed[request.request_id] = len(table) - len(blocks)
        host_blocks = self.host_pool.allocate(len(blocks))
        self._transfers.swap_out += [(d.block_id, h.block_id) for d, h in zip(blocks, host_blocks)]
        self.host_pool.touch(host_blocks)  # held by the step's copy, and by the request
        self._held_host_blocks += host_blocks
        self.req_to_host_blocks[request.request_id] = host_blocks
        self.num_swapped_out_blocks += len(blocks)
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free(blocks)

    def is_swapped_out(self, request: Request) -> bool:
        return request.request_id in self.req_to_host_blocks

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block table, sharing every block (the child has the same tokens)."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.block_pool.touch(live(blocks))
        self.req_to_blocks[child.request_id] = list(blocks)
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(parent.request_id, 0)

    def take_transfers(self) -> Transfers:
        transfers, self._transfers = self._transfers, Transfers()
        return transfers

    def finish_step(self) -> None:
        """The step's copies are done: release the host blocks they held."""
        if self._held_host_blocks:
            self.host_pool.free(self._held_host_blocks)
            self._held_host_blocks = []

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())[start:]]

    def take_rewritten_table(self, request_id: str) -> bool:
        """Whether a block of the request's table was replaced in place (copy-on-write) since the last call."""
        if request_id in self._rewritten_tables:
            self._rewritten_tables.discard(request_id)
            return True
        return False

    def free(self, request: Request) -> None:
        """Release everything the request holds, in either tier."""
        self._num_cached_blocks.pop(request.request_id, None)
        self._rewritten_tables.discard(request.request_id)
        self._swapped_num_freed.pop(request.request_id, None)
        blocks = live(self.req_to_blocks.pop(request.request_id, []))
        if blocks:
            self.block_pool.free(blocks)
        host_blocks = self.req_to_host_blocks.pop(request.request_id, None)
        if host_blocks:
            self.host_pool.free(host_blocks)

    def token_efficiency(self, num_computed: dict[str, int]) -> float:
        """Tokens stored / capacity of the blocks requests hold, each physical block counted once. `num_computed`:
        request id -> its computed tokens. Only a table's last block can be partly filled (the ones before it are
        full), so this looks at one block per table, not at every block: it runs after every step."""
        waste: dict[int, int] = {}  # last block id -> its empty slots (a block shared by forks counted once)
        for request_id, blocks in self.req_to_blocks.items():
            if blocks and blocks[-1] is not NULL_BLOCK:
                empty = max(len(blocks) * self.block_size - num_computed.get(request_id, 0), 0)
                last = blocks[-1].block_id
                waste[last] = min(waste.get(last, empty), empty)
        capacity = self.block_pool.num_used_blocks * self.block_size
        return 1.0 - sum(waste.values()) / capacity if capacity else 1.0

    def check_consistency(self, live_request_ids: set[str]) -> None:
        """Raise RuntimeError unless only live requests hold blocks and every block's ref count equals the number of
        holders, in both tiers (checked after a failed step, before the engine goes on)."""
        stray = (set(self.req_to_blocks) | set(self.req_to_host_blocks)) - live_request_ids
        if stray:
            raise RuntimeError(f"Finished requests still hold KV blocks: {sorted(stray)[:10]}.")
        self.block_pool.check_ref_counts(Counter(b.block_id for blocks in self.req_to_blocks.values()
                                                 for b in live(blocks)))
        if set(self._swapped_num_freed) - set(self.req_to_host_blocks):
            raise RuntimeError("A request that is not swapped out keeps a swapped table's freed entries.")
        if self.host_pool is not None:
            holders = Counter(b.block_id for blocks in self.req_to_host_blocks.values() for b in blocks)
            holders.update(b.block_id for b in self._held_host_blocks)
            self.host_pool.check_ref_counts(holders)
