"""Block tables: which physical blocks hold each request's K/V, grown on demand, shared between forked sequences
(n > 1, beam search) and copied on write, freed at once."""
from __future__ import annotations

from collections import Counter

from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # (source, destination) block copies owed to the workers before the next forward pass.
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_logical_blocks(self) -> int:
        """Blocks the live block tables would hold if nothing were shared."""
        return sum(len(blocks) for blocks in self.req_to_blocks.values())

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more K/V entries after `request.num_computed_tokens`.

        The first slot written may lie in a partly filled block another sequence also holds (after a fork): that
        block is copied on write, so the other holders keep their K/V. Returns False, changing nothing, when the
        pool is too small right now (the caller may preempt).
        """
        blocks = self.req_to_blocks.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        copy_on_write = num_new_tokens > 0 and first < len(blocks) and blocks[first].ref_cnt > 1
        needed = self.num_blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if max(needed, 0) + copy_on_write > self.block_pool.num_free_blocks:
            return False
        if copy_on_write:
            shared = blocks[first]
            (private,) = self.block_pool.allocate(1)
            self.block_pool.free([shared])
            blocks[first] = private
            self._pending_copies.append((shared.block_id, private.block_id))
        if needed > 0:
            self.req_to_blocks[request.request_id] = blocks + self.block_pool.allocate(needed)
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block table, sharing every block (the child has the same tokens)."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.block_pool.share(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free(blocks)

    def check_consistency(self, live_request_ids: set[str]) -> None:
        """Raise RuntimeError unless only live requests hold block tables and every block's ref count equals the
        number of tables holding it (checked after a failed step, before the engine goes on)."""
        stray = set(self.req_to_blocks) - live_request_ids
        if stray:
            raise RuntimeError(f"Finished requests still hold KV blocks: {sorted(stray)[:10]}.")
        self.block_pool.check_ref_counts(Counter(b.block_id for blocks in self.req_to_blocks.values()
                                                 for b in blocks))
