"""The prefix cache over the block tables: once a full block's K/V are computed it is indexed under its chained hash
(see block_hash.py) and its group (`group_key`), and a new request takes every cached block of its prefix and
computes only the rest (the longest prefix every KV cache group has, on the device, then in the host tier: see
prefix_hit.py). Freed blocks stay cached until the pool needs them (see BlockPool). Also the hit statistics.

The tables themselves are the `KVCacheManager`'s, which grows, swaps and frees them; this module reads them and keeps
each table's count of indexed blocks (`GroupTables.num_cached_blocks`).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.kv.block_hash import extend_block_hashes
from pagellm.core.kv.block_pool import BlockPool
from pagellm.core.kv.group_tables import GroupTables
from pagellm.core.kv.prefix_hit import ComputedBlocks, find_prefix_hit, group_key
from pagellm.core.kv.sliding_window import NULL_BLOCK
from pagellm.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative, in tokens. A preempted request finding its own blocks again is counted apart."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


class PrefixCache:
    def __init__(self, groups: list[GroupTables], block_size: int, block_pool: BlockPool,
                 host_pool: BlockPool | None, enabled: bool) -> None:
        """`groups`: every KV cache group's tables (the manager's); `block_pool`, `host_pool`: the device and host
        tiers; `enabled`: with False nothing is indexed or found."""
        self.groups = groups
        self.windows = [group.window for group in groups]
        self.block_size = block_size
        self.block_pool = block_pool
        self.host_pool = host_pool
        self.enabled = enabled
        self.stats = PrefixCacheStats()

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of the request's tokens, in whole blocks, that every group has, leaving at
        least its last token to compute (its logits are needed). Changes nothing."""
        if not self.enabled or request.skip_reading_prefix_cache:
            return ComputedBlocks()  # cached positions have no logits or hidden states to report
        hashes = self._block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        return find_prefix_hit(hashes, self.windows, self.block_size, self.block_pool, self.host_pool)

    def _block_hashes(self, request: Request) -> list[bytes]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
                            request.lora_request.lora_int_id if request.lora_request else None)
        return request.block_hashes

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks whose K/V are now all computed."""
        if not self.enabled:
            return
        request_id = request.request_id
        for g, group in enumerate(self.groups):
            blocks = group.req_to_blocks.get(request_id, [])
            num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
            start = group.num_cached_blocks.get(request_id, 0)
            if num_full <= start:
                continue
            hashes = self._block_hashes(request)
            for index in range(start, num_full):
                if blocks[index] is not NULL_BLOCK:
                    self.block_pool.cache(blocks[index], group_key(hashes[index], g))
            group.num_cached_blocks[request_id] = num_full

    def record_hit(self, request: Request, num_tokens: int) -> None:
        """Count `num_tokens` of the request's prefix taken from the cache."""
        if request.num_preemptions:
            self.stats.preempted_hits += num_tokens
        else:
            self.stats.hits += num_tokens

    def record_query(self, request: Request) -> None:
        """Count a request's admission as a query of all its tokens (vLLM's convention, although the last one is
        always computed)."""
        if not self.enabled or request.skip_reading_prefix_cache:
            return
        if request.num_preemptions:
            self.stats.preempted_queries += request.num_tokens
        else:
            self.stats.queries += request.num_tokens
