"""KV cache groups: which layers share a block table (vLLM's hybrid allocator layout).

Layers are grouped by attention type (full attention, or a sliding window of W tokens). Every group has the same
number of layers (`group_size`, the smallest type's layer count; a type's last group may have fewer), so a block
is one page of `group_size` layers' K/V whatever group holds it: the cache has `group_size` tensors and layer i of
group g reads and writes its group's block ids in tensor `position(i)` (see worker/cache_engine.py). One block
pool serves every group; each request holds one block table per group, and a sliding group's table frees the
blocks that fell out of its window (core/kv/kv_cache_manager.py). A model whose layers all attend the same way
(Llama: all full; Mistral: all one window) is one group of every layer, as before.

Gemma 3 270M (18 layers, every sixth global): 3 full + 15 sliding layers -> one full group and five sliding groups
of 3 layers; a block is 3 layers' page.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.kv.sliding_window import num_skipped_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    window: int | None  # the group's sliding window (None: full attention)
    layers: tuple[int, ...]  # model layer indices, in order; layers[p] uses cache tensor p


def kv_cache_groups(windows: list[int | None]) -> list[KVCacheGroup]:
    """Groups of the layers whose sliding windows are `windows` (one entry per model layer, None: full attention),
    full attention first, then windows from the smallest; within a type, layers in order."""
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_type.setdefault(window, []).append(layer)
    if len(by_type) <= 1:
        return [KVCacheGroup(window, tuple(layers)) for window, layers in by_type.items()]
    size = min(len(layers) for layers in by_type.values())
    order = sorted(by_type, key=lambda w: (w is not None, w or 0))
    return [KVCacheGroup(window, tuple(by_type[window][start:start + size]))
            for window in order for start in range(0, len(by_type[window]), size)]


def group_size(groups: list[KVCacheGroup]) -> int:
    """Layers per block page: the cache's number of tensors."""
    return max(len(group.layers) for group in groups)


def layer_positions(groups: list[KVCacheGroup]) -> dict[int, tuple[int, int]]:
    """Model layer -> (its group, its cache tensor)."""
    return {layer: (g, position) for g, group in enumerate(groups) for position, layer in enumerate(group.layers)}


def blocks_needed(windows: list[int | None], num_computed: int, num_new: int, block_size: int) -> int:
    """Blocks a request holds, summed over the groups (their `windows`), while computing `num_new` tokens after
    `num_computed`: a full group every token's, a sliding group only its window's and the new tokens'."""
    total = cdiv(num_computed + num_new, block_size)
    return sum(total - num_skipped_blocks(num_computed, window, block_size) for window in windows)
