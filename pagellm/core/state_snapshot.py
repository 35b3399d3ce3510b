"""A plain, JSON-able picture of the scheduler's queues and the KV block pools, for the live dashboard.

It reads scheduler and block-pool state that only the engine thread may touch, so it must run there, between
steps (AsyncLLM.get_engine_state does that). It is compact because it is taken a few times a second while a
dashboard is open: each pool is one string with a character per block (see BLOCK_CODES) rather than an object per
block, and covers only the blocks created so far (the pools create blocks on first use; the rest are free and never
used, so a host tier of millions of blocks costs nothing here either). Each request lists the ids of the blocks it
holds in every KV cache group (and per group), without the entries freed because they fell out of a sliding window
(counted apart); `kv_cache_groups` gives each group's window, the blocks its tables hold and the blocks it freed.
"""
from __future__ import annotations

from typing import Any

from pagellm.core.kv.block_pool import BlockPool
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.kv.sliding_window import live
from pagellm.core.request import Request
from pagellm.core.sched.scheduler import Scheduler

# One character per block: free (no contents worth keeping), cached-but-free (a prefix-cache block nobody holds:
# reusable, evictable), used by one sequence, shared by several (ref count > 1: n > 1, beams, common prefixes).
FREE, CACHED, USED, SHARED = ".", "c", "u", "s"
BLOCK_CODES = {FREE: "free", CACHED: "cached", USED: "used", SHARED: "shared"}
# A queue longer than this is summarised by its length: the page cannot show thousands of rows usefully anyway.
MAX_LISTED_REQUESTS = 256


def pool_state(pool: BlockPool) -> dict[str, Any]:
    """`states`: a BLOCK_CODES character per created block (block id = index); blocks past its end are free."""
    codes = bytearray(FREE * len(pool.blocks), "ascii")
    for block in pool.blocks:
        if block.ref_cnt > 1:
            codes[block.block_id] = ord(SHARED)
        elif block.ref_cnt == 1:
            codes[block.block_id] = ord(USED)
        elif block.block_hash is not None:
            codes[block.block_id] = ord(CACHED)
    states = codes.decode("ascii")
    counts = {name: states.count(code) for code, name in BLOCK_CODES.items()}
    counts["free"] += pool.num_blocks - len(pool.blocks)
    return {"num_blocks": pool.num_blocks, "states": states, "counts": counts}


def request_state(request: Request, manager: KVCacheManager) -> dict[str, Any]:
    tables = [group.req_to_blocks.get(request.request_id, []) for group in manager.groups]
    group_blocks = [[block.block_id for block in live(table)] for table in tables]
    return {
        "request_id": request.request_id,
        "group_id": request.group_id,  # the user's request: its n sequences or beams share it (and a colour)
        "status": request.status.name.lower(),
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_tokens": request.num_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "num_output_tokens": request.num_output_tokens,
        "max_tokens": request.max_tokens,
        "num_cached_tokens": request.num_cached_tokens,
        "num_preemptions": request.num_preemptions,
        "priority": request.priority,
        "blocks": [block_id for blocks in group_blocks for block_id in blocks],
        "group_blocks": group_blocks,  # per KV cache group
        "num_window_freed_blocks": sum(len(table) for table in tables) - sum(map(len, group_blocks)),
        "host_blocks": [block.block_id for group in manager.groups
                        for block in group.req_to_host_blocks.get(request.request_id, ())],
    }


def group_state(manager: KVCacheManager) -> list[dict[str, Any]]:
    """Each KV cache group: its window (None: full attention), the blocks its tables hold (a block shared by forks
    counted once per table) and the blocks it freed as they left its window, in all."""
    return [{"window": group.window, "num_blocks": sum(len(live(t)) for t in group.req_to_blocks.values()),
             "window_freed_blocks_total": group.num_window_freed_blocks} for group in manager.groups]


def engine_state(scheduler: Scheduler) -> dict[str, Any]:
    """The queues (running in admission order, waiting in the policy's order) and both KV tiers right now."""
    manager = scheduler.kv_cache_manager
    return {
        "block_size": manager.block_size,
        "prefix_caching": manager.enable_prefix_caching,
        "sliding_window": manager.sliding_window,  # the window every layer shares (None: none, or several groups)
        "window_freed_blocks_total": manager.num_window_freed_blocks,
        "kv_cache_groups": group_state(manager),
        "device": pool_state(manager.block_pool),
        "host": pool_state(manager.host_pool) if manager.host_pool is not None else None,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "running": [request_state(r, manager) for r in scheduler.running[:MAX_LISTED_REQUESTS]],
        "waiting": [request_state(r, manager) for _, r in zip(range(MAX_LISTED_REQUESTS), scheduler.waiting)],
        "num_preemptions_total": scheduler.num_preemptions_total,
    }
