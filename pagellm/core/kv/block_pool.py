"""The pool of physical KV-cache blocks: ids, reference counts, the free queue and the prefix-cache index.

A block is free exactly when its ref count is zero. A free block may still hold the K/V of a full block that a
request computed earlier, with its hash: such a block is *cached* and can be taken back by a later request with
the same prefix (`touch`). The free queue is also the eviction order (least recently freed first): a cached block
loses its hash only when a fresh block is needed and it is at the head of the queue.

Block objects are created on first use (ids in order), and never-used blocks are handed out before any block of
the free queue: a host tier of millions of small blocks costs nothing until it fills, and nothing cached is
evicted while never-used blocks remain.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block holds a cached full block
    # Neighbours in the free queue (None when not free, or at an end).
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """A doubly linked list of free blocks: O(1) pop from the head, append at the tail and removal from the
    middle (a prefix-cache hit on a free block takes it out wherever it is)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: every real block has two neighbours
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("No free KV block is left.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every physical block of one memory tier (the device cache, or the host tier)."""

    def __init__(self, num_blocks: int, on_evict: Callable[[KVCacheBlock], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"A KV block pool needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks: list[KVCacheBlock] = []  # every block used so far; block_id == index
        self.free_queue = FreeBlockQueue([])
        self.cached: dict[bytes, KVCacheBlock] = {}  # block hash -> the block holding it
        # Called with a cached block just before it loses its hash and contents (the host tier keeps a copy).
        self.on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached and never-used ones included."""
        return self.free_queue.num_free + self.num_blocks - len(self.blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, num: int) -> list[KVCacheBlock]:
        """`num` blocks with ref count 1: never-used ones first, then from the head of the free queue (evicting
        cached ones)."""
        if num > self.num_free_blocks:
            raise RuntimeError(f"Asked for {num} KV blocks but only {self.num_free_blocks} are free.")
        blocks = []
        for _ in range(num):
            if len(self.blocks) < self.num_blocks:
                block = KVCacheBlock(len(self.blocks))
                self.blocks.append(block)
            else:
                block = self.free_queue.popleft()
                if block.block_hash is not None:
                    self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if self.on_evict is not None:
            self.on_evict(block)
        del self.cached[block.block_hash]
        block.block_hash = None

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add one reference to each block: cache hits (which may be free) and forks (which are held)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Index a held block that now holds a full block of K/V. When another block already holds the same hash
        (two requests computed the same prefix at once), the first stays the cached one."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds join the tail of the free queue.

        Freed in reverse, so a sequence's tail blocks are evicted before its head blocks (a later request is more
        likely to share the head).
        """
        self._check_held(blocks)
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_cache(self) -> None:
        """Forget every cached free block (their contents are no longer trusted)."""
        for block in self.free_queue:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None

    def check_ref_counts(self, holders: Counter[int]) -> None:
        """Raise RuntimeError unless every block's ref count equals `holders[block_id]` (how many block tables hold
        it), the free queue holds exactly the unreferenced blocks, once each, and the hash index points at blocks
        carrying those hashes."""
        wrong = [b.block_id for b in self.blocks if b.ref_cnt != holders.get(b.block_id, 0)]
        if wrong:
            raise RuntimeError(f"KV block ref counts disagree with the block tables for blocks {wrong[:10]}.")
        queued = [b.block_id for b in self.free_queue]
        if len(queued) != self.free_queue.num_free or sorted(queued) != [b.block_id for b in self.blocks
                                                                           if b.ref_cnt == 0]:
            raise RuntimeError("The KV free queue does not hold exactly the unreferenced blocks.")
        if any(block.block_hash != block_hash for block_hash, block in self.cached.items()) or \
                sum(b.block_hash is not None for b in self.blocks) != len(self.cached):
            raise RuntimeError("The prefix-cache index disagrees with the blocks' hashes.")

    @staticmethod
    def _check_held(blocks: list[KVCacheBlock]) -> None:
        """Fail before changing anything if a block is free (double free) or listed more times than held."""
        counts: dict[int, int] = {}
        for block in blocks:
            counts[block.block_id] = counts.get(block.block_id, 0) + 1
            if counts[block.block_id] > block.ref_cnt:
                raise RuntimeError(f"KV block {block.block_id} is released more times than it is held "
                                   f"(ref count {block.ref_cnt}): double free.")
