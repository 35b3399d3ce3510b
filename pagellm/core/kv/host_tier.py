"""The device block pool with the host tier beneath it, and the block moves a step owes the workers.

Host tier (when it has blocks): a second BlockPool whose blocks mirror device blocks in host memory. A cached
device block that is evicted is copied to a host block first, keeping its hash, and a later prefix hit on it is
copied back instead of recomputed; a request preempted by swapping has its blocks copied out and back in. The
copies are only listed here (`take_transfers`, with the device-to-device copies of copy-on-write); the workers make
them before the step's forward pass. Host blocks a step's copies read or write are held until the step has run
(`finish_step`), so no later decision in the same step can reuse them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagellm.core.kv.block_pool import BlockPool, KVCacheBlock


@dataclass(slots=True)
class Transfers:
    """The block moves one step owes the workers, in the order they are made (see SchedulerOutput)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device source, device destination)


class TieredBlocks:
    """The device pool (`device`), the host pool (`host`, None without a host tier) and the step's moves."""

    def __init__(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.device = BlockPool(num_blocks, on_evict=self._save_to_host if num_host_blocks else None)
        self.host = BlockPool(num_host_blocks) if num_host_blocks else None
        self.held_host_blocks: list[KVCacheBlock] = []  # read or written by this step's copies
        self._transfers = Transfers()
        # Blocks copied to and from the host tier (swap preemption and the second-level prefix cache).
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def copy_on_write(self, shared: KVCacheBlock) -> KVCacheBlock:
        """A private device copy of `shared`, whose reference the caller gives up."""
        (private,) = self.device.allocate(1)
        self.device.free([shared])
        self._transfers.copies.append((shared.block_id, private.block_id))
        return private

    def load_from_host(self, host_blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Fresh device blocks receiving copies of `host_blocks` this step. The caller's reference to each host block
        (a prefix hit's, or a swapped-out request's own) is dropped once the step is over."""
        self.held_host_blocks += host_blocks
        device_blocks = self.device.allocate(len(host_blocks))
        self._transfers.swap_in += [(h.block_id, d.block_id) for h, d in zip(host_blocks, device_blocks)]
        self.num_swapped_in_blocks += len(host_blocks)
        return device_blocks

    def copy_to_host(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Host blocks receiving copies of the device `blocks` this step, held by the caller until it frees them;
        the device blocks stay the caller's to free."""
        assert self.host is not None, "swapping out needs a host tier"
        host_blocks = self.host.allocate(len(blocks))
        self._transfers.swap_out += [(d.block_id, h.block_id) for d, h in zip(blocks, host_blocks)]
        self.host.touch(host_blocks)  # held by the step's copy, and by the caller
        self.held_host_blocks += host_blocks
        self.num_swapped_out_blocks += len(blocks)
        return host_blocks

    def _save_to_host(self, block: KVCacheBlock) -> None:
        """Eviction hook of the device pool: keep a copy of the cached block in the host tier when a host block is
        free (the host tier evicts its own least recently used copy for it)."""
        assert self.host is not None
        if block.block_hash in self.host.cached or not self.host.num_free_blocks:
            return
        (host_block,) = self.host.allocate(1)
        self.host.cache(host_block, block.block_hash)
        self._transfers.swap_out.append((block.block_id, host_block.block_id))
        self.held_host_blocks.append(host_block)
        self.num_swapped_out_blocks += 1

    def take_transfers(self) -> Transfers:
        transfers, self._transfers = self._transfers, Transfers()
        return transfers

    def finish_step(self) -> None:
        """The step's copies are done: release the host blocks they held."""
        if self.held_host_blocks:
            assert self.host is not None
            self.host.free(self.held_host_blocks)
            self.held_host_blocks = []

    def reset_cache(self) -> None:
        """Forget every cached block nobody holds, in both tiers (after a failed step, whose copies may not have
        happened)."""
        self.finish_step()
        self.device.reset_cache()
        if self.host is not None:
            self.host.reset_cache()

    def check_host_ref_counts(self, holders: Counter[int]) -> None:
        """Raise unless every host block's ref count is its holders' count: `holders` (block tables) and this step's
        copies."""
        if self.host is not None:
            self.host.check_ref_counts(holders + Counter(b.block_id for b in self.held_host_blocks))
