"""Which blocks a sliding window still reads, for the KV cache manager: a query at position q reads the keys
q - W < k <= q, so the blocks wholly before the first query's window can be freed, and a prefix hit needs only the
blocks the next query's window reads. A freed table entry is `NULL_BLOCK`, which keeps block tables positional.
"""
from __future__ import annotations

from pagellm.core.kv.block_pool import BlockPool, KVCacheBlock

# A freed table entry: held by no one and never ref counted; its id pads tables as block 0 does.
NULL_BLOCK = KVCacheBlock(0)


def live(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
    return [block for block in blocks if block is not NULL_BLOCK]


def num_skipped_blocks(num_computed: int, window: int | None, block_size: int) -> int:
    """Leading blocks no query from position `num_computed` on reads: wholly before its window."""
    return 0 if window is None else max(0, num_computed - window + 1) // block_size


def window_hit(pool: BlockPool, hashes: list[bytes], window: int, block_size: int) -> list[KVCacheBlock]:
    """The longest prefix of `hashes` whose blocks the next query's window reads are all cached in `pool` (the
    ones before the window may be gone: they come back as NULL_BLOCK entries), scanning back from the end."""
    run = 0  # cached blocks ending at the candidate prefix's end
    for index in range(len(hashes) - 1, -1, -1):
        if pool.lookup(hashes[index]) is None:
            run = 0
            continue
        run += 1
        end = index + run
        first = num_skipped_blocks(end * block_size, window, block_size)
        if index <= first:
            return [NULL_BLOCK] * first + [pool.cached[block_hash] for block_hash in hashes[first:end]]
    return []
