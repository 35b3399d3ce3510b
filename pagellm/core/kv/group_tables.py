"""One KV cache group's block tables (`GroupTables`), and what is read off every group's tables at once: the checks
that they agree with each other and with the pools' ref counts, and the token efficiency of the blocks they hold."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagellm.core.kv.block_pool import KVCacheBlock
from pagellm.core.kv.sliding_window import NULL_BLOCK, live


@dataclass(slots=True, eq=False)
class GroupTables:
    """One KV cache group's block tables: on the device, and swapped out to the host tier."""

    window: int | None  # None: full attention
    req_to_blocks: dict[str, list[KVCacheBlock]] = field(default_factory=dict)
    req_to_host_blocks: dict[str, list[KVCacheBlock]] = field(default_factory=dict)
    swapped_num_freed: dict[str, int] = field(default_factory=dict)  # a swapped-out table's NULL_BLOCK entries
    num_cached_blocks: dict[str, int] = field(default_factory=dict)  # how many of a table's blocks are indexed
    num_window_freed_blocks: int = 0  # cumulative: blocks freed because they fell out of the window


def check_tables(groups: list[GroupTables], live_request_ids: set[str]) -> None:
    """Raise RuntimeError unless only live requests hold blocks and every group holds the same requests with tables
    of the same length."""
    for group in groups:
        stray = (set(group.req_to_blocks) | set(group.req_to_host_blocks)) - live_request_ids
        if stray:
            raise RuntimeError(f"Finished requests still hold KV blocks: {sorted(stray)[:10]}.")
        if set(group.swapped_num_freed) - set(group.req_to_host_blocks):
            raise RuntimeError("A request that is not swapped out keeps a swapped table's freed entries.")
    first = groups[0]
    for group in groups[1:]:
        if ({rid: len(t) for rid, t in group.req_to_blocks.items()}
                != {rid: len(t) for rid, t in first.req_to_blocks.items()}
                or set(group.req_to_host_blocks) != set(first.req_to_host_blocks)):
            raise RuntimeError("The KV cache groups' block tables disagree on the requests or their lengths.")


def device_holders(groups: list[GroupTables]) -> Counter[int]:
    """Device block id -> how many tables hold it."""
    return Counter(b.block_id for group in groups for blocks in group.req_to_blocks.values() for b in live(blocks))


def host_holders(groups: list[GroupTables]) -> Counter[int]:
    """Host block id -> how many swapped-out tables hold it."""
    return Counter(b.block_id for group in groups for blocks in group.req_to_host_blocks.values() for b in blocks)


def token_efficiency(groups: list[GroupTables], num_computed: dict[str, int], block_size: int,
                     num_used_blocks: int) -> float:
    """Tokens stored / capacity of the `num_used_blocks` blocks the tables hold, each physical block counted once.
    `num_computed`: request id -> its computed tokens. Only a table's last block can be partly filled (the ones
    before it are full), so this looks at one block per table, not at every block: it runs after every step."""
    waste: dict[int, int] = {}  # last block id -> its empty slots (a block shared by forks counted once)
    for group in groups:
        for request_id, blocks in group.req_to_blocks.items():
            if blocks and blocks[-1] is not NULL_BLOCK:
                empty = max(len(blocks) * block_size - num_computed.get(request_id, 0), 0)
                last = blocks[-1].block_id
                waste[last] = min(waste.get(last, empty), empty)
    capacity = num_used_blocks * block_size
    return 1.0 - sum(waste.values()) / capacity if capacity else 1.0
