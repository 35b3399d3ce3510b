"""The pool of physical KV-cache blocks: ids, reference counts and the free list."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Owns every physical block. A block is free exactly when its ref count is zero."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"A KV block pool needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_ids)

    def allocate(self, num: int) -> list[KVCacheBlock]:
        if num > len(self._free_ids):
            raise RuntimeError(f"Asked for {num} KV blocks but only {len(self._free_ids)} are free.")
        blocks = [self.blocks[self._free_ids.popleft()] for _ in range(num)]
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def share(self, blocks: list[KVCacheBlock]) -> None:
        """Add one reference to each block (another block table now holds it)."""
        for block in blocks:
            if block.ref_cnt == 0:
                raise RuntimeError(f"KV block {block.block_id} is free and cannot be shared.")
        for block in blocks:
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go back to the free list.

        Freed in reverse, so a sequence's tail blocks join the free list before its head blocks.
        """
        self._check_held(blocks)
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_ids.append(block.block_id)

    def check_ref_counts(self, holders: Counter[int]) -> None:
        """Raise RuntimeError unless every block's ref count equals `holders[block_id]` (how many block tables hold
        it) and the free list holds exactly the unreferenced blocks, once each."""
        wrong = [b.block_id for b in self.blocks if b.ref_cnt != holders.get(b.block_id, 0)]
        if wrong:
            raise RuntimeError(f"KV block ref counts disagree with the block tables for blocks {wrong[:10]}.")
        unreferenced = [b.block_id for b in self.blocks if b.ref_cnt == 0]
        if sorted(self._free_ids) != unreferenced:
            raise RuntimeError("The KV free list does not hold exactly the unreferenced blocks.")

    @staticmethod
    def _check_held(blocks: list[KVCacheBlock]) -> None:
        """Fail before changing anything if a block is free (double free) or listed more times than held."""
        counts: dict[int, int] = {}
        for block in blocks:
            counts[block.block_id] = counts.get(block.block_id, 0) + 1
            if counts[block.block_id] > block.ref_cnt:
                raise RuntimeError(f"KV block {block.block_id} is released more times than it is held "
                                   f"(ref count {block.ref_cnt}): double free.")
