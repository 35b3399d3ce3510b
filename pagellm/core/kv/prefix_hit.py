"""Prefix-cache lookups across KV cache groups: a request's longest cached prefix that every group has.

A block's prefix-cache key is its hash and its group (`group_key`), so groups never share K/V. A prefix hit is the
longest length every group has: a full-attention group needs every block, a sliding group only the blocks the next
query's window reads (vLLM's sliding-window lookup), the ones before it coming back as `NULL_BLOCK` placeholders.
Blocks no longer on the device may be found in the host tier, after the device ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.kv.block_pool import BlockPool, KVCacheBlock
from pagellm.core.kv.sliding_window import NULL_BLOCK, num_skipped_blocks, window_hit


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of `group` (the first group's is the hash itself)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


@dataclass(slots=True)
class ComputedBlocks:
    """A request's prefix found in the cache: blocks on the device, then blocks only the host tier still has. These
    are the first group's; `others` holds the other groups' hits, of the same length."""

    device: list[KVCacheBlock] = field(default_factory=list)
    host: list[KVCacheBlock] = field(default_factory=list)
    others: list[ComputedBlocks] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.host)

    def group(self, index: int) -> ComputedBlocks:
        if index == 0:
            return self
        return self.others[index - 1] if self.others else ComputedBlocks()


def find_prefix_hit(hashes: list[bytes], windows: list[int | None], block_size: int, device: BlockPool,
                    host: BlockPool | None) -> ComputedBlocks:
    """The longest prefix of the blocks `hashes` cached for every group (`windows`: each group's sliding window,
    None for full attention). Changes nothing: the caller takes the blocks."""
    keys = [[group_key(h, g) for h in hashes] if g else hashes for g in range(len(windows))]
    chains = [_chain_hit(group_keys, device, host) for group_keys in keys]
    # A sliding group may hit a length its chain does not reach (the window's blocks are cached, the head
    # evicted), but not every shorter one: shrink to a length every group has.
    length = len(hashes)
    while True:
        found = min(_hit_length(keys[g], chains[g], length, windows[g], block_size, device)
                    for g in range(len(windows)))
        if found == length:
            break
        length = found
    hits = []
    for g, chain in enumerate(chains):
        window = windows[g]
        if chain.num_blocks >= length:
            hit_device, hit_host = chain.device[:length], chain.host[:length - len(chain.device[:length])]
            # A sliding group takes no block before the next query's window (it would free it at once).
            skip = num_skipped_blocks(length * block_size, window, block_size)
            if skip > len(hit_device):
                hit_device, hit_host = [NULL_BLOCK] * skip, hit_host[skip - len(hit_device):]
            elif skip:
                hit_device = [NULL_BLOCK] * skip + hit_device[skip:]
            hits.append(ComputedBlocks(hit_device, hit_host))
        else:
            assert window is not None, "a full group's hit is its chain"
            hits.append(ComputedBlocks(window_hit(device, keys[g][:length], window, block_size)))
    hits[0].others = hits[1:]
    return hits[0]


def _chain_hit(keys: list[bytes], device: BlockPool, host: BlockPool | None) -> ComputedBlocks:
    """The blocks of the longest prefix of `keys` cached on the device, then in the host tier."""
    computed = ComputedBlocks()
    for key in keys:
        block = None if computed.host else device.lookup(key)
        if block is not None:
            computed.device.append(block)
            continue
        block = host.lookup(key) if host is not None else None
        if block is None:
            break
        computed.host.append(block)
    return computed


def _hit_length(keys: list[bytes], chain: ComputedBlocks, limit: int, window: int | None, block_size: int,
                device: BlockPool) -> int:
    """The longest hit of one group at most `limit` blocks long."""
    if chain.num_blocks >= limit or window is None:
        return min(chain.num_blocks, limit)
    return max(chain.num_blocks, len(window_hit(device, keys[:limit], window, block_size)))
