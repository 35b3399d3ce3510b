"""LoadAwareRouter: which data-parallel replica a new request goes to.

Load: the requests a replica holds (routed to it and not yet finished, known exactly on this side), with each
waiting request (from the replica's latest scheduler snapshot) weighing `WAITING_WEIGHT` times more, since a
queue means the replica is saturated; ties go to the replica with the lower KV-cache usage.

Prefix affinity (with prefix caching on): a request whose prompt begins with full blocks recently sent to a
replica goes to that replica, where those blocks are likely still cached, unless it is more than
`PREFIX_AFFINITY_SLACK` load units busier than the least loaded one. Each replica's recent block hashes are kept
in an LRU as large as its KV pools (device + host tier) hold prompt blocks, so the guess ages as the replica's own
cache does: a model with several KV cache groups (Gemma 3's windows) caches a page per group for each block.
"""
from __future__ import annotations

from collections import OrderedDict

from pagellm.core.kv.block_hash import extend_block_hashes
from pagellm.core.request import Request
from pagellm.metrics.stats import SchedulerStats

WAITING_WEIGHT = 4
PREFIX_AFFINITY_SLACK = 4


class LoadAwareRouter:
    def __init__(self, initial_stats: list[SchedulerStats], block_size: int, prefix_affinity: bool) -> None:
        self.num_replicas = len(initial_stats)
        self.block_size = block_size
        self.prefix_affinity = prefix_affinity
        self.in_flight = [0] * self.num_replicas
        self._stats = list(initial_stats)
        self._recent_blocks: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in initial_stats]
        self._capacity = [(stats.num_blocks + stats.num_host_blocks) // stats.num_kv_cache_groups
                          for stats in initial_stats]

    def load(self, replica: int) -> int:
        return self.in_flight[replica] + WAITING_WEIGHT * self._stats[replica].num_waiting

    def route(self, request: Request) -> int:
        """Pick the replica for `request` and count it there until `release`."""
        least = min(range(self.num_replicas), key=lambda r: (self.load(r), self._stats[r].kv_cache_usage))
        chosen = least
        if self.prefix_affinity:
            hashes: list[bytes] = []
            extend_block_hashes(hashes, request.prompt_token_ids, self.block_size, request.cache_salt)
            best_match = 0
            for replica in range(self.num_replicas):
                match = self._matched_blocks(replica, hashes)
                if match > best_match and self.load(replica) <= self.load(least) + PREFIX_AFFINITY_SLACK:
                    chosen, best_match = replica, match
            self._remember(chosen, hashes)
        self.in_flight[chosen] += 1
        return chosen

    def release(self, replica: int, num_requests: int) -> None:
        """`num_requests` routed to `replica` have left it (finished, failed, aborted or refused)."""
        self.in_flight[replica] -= num_requests

    def observe(self, replica: int, stats: SchedulerStats) -> None:
        self._stats[replica] = stats

    def _matched_blocks(self, replica: int, hashes: list[bytes]) -> int:
        recent = self._recent_blocks[replica]
        for matched, block_hash in enumerate(hashes):
            if block_hash not in recent:
                return matched
        return len(hashes)

    def _remember(self, replica: int, hashes: list[bytes]) -> None:
        recent = self._recent_blocks[replica]
        for block_hash in hashes:
            recent[block_hash] = None
            recent.move_to_end(block_hash)
        while len(recent) > self._capacity[replica]:
            recent.popitem(last=False)
