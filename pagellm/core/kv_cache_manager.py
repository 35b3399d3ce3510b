"""Block tables: which physical blocks hold each request's K/V, grown on demand, freed at once."""
from __future__ import annotations

from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more K/V entries after `request.num_computed_tokens`.

        Returns False, allocating nothing, when the pool is too small right now (the caller may preempt).
        """
        blocks = self.req_to_blocks.get(request.request_id, [])
        needed = self.num_blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if needed > self.block_pool.num_free_blocks:
            return False
        if needed > 0:
            self.req_to_blocks[request.request_id] = blocks + self.block_pool.allocate(needed)
        return True

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free(blocks)
