"""A plain, JSON-able picture of the scheduler's queues and the KV block pools, for the live dashboard.

It reads scheduler and block-pool state that only the engine thread may touch, so it must run there, between
steps (AsyncLLM.get_engine_state does that). It is compact because it is taken a few times a second while a
dashboard is open: each pool is one string with a character per block (see BLOCK_CODES) rather than an object per
block, and covers only the blocks created so far (the pools create blocks on first use; the rest are free and never
used, so a host tier of millions of blocks costs nothing here either). Each request lists its block table as ids,
without the entries freed because they fell out of a sliding window (counted apart).
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
    table = manager.req_to_blocks.get(request.request_id, [])
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
        "blocks": [block.block_id for block in live(table)],
        "num_window_freed_blocks": len(table) - len(live(table)),
        "host_blocks": [block.block_id for block in manager.req_to_host_blocks.get(request.request_id, ())],
    }


def engine_state(scheduler: Scheduler) -> dict[str, Any]:
    """The queues (running in admission order, waiting in the policy's order) and both KV tiers right now."""
    manager = scheduler.kv_cache_manager
    return {
        "block_size": manager.block_size,
        "prefix_caching": manager.enable_prefix_caching,
        "sliding_window": manager.sliding_window,  # None unless blocks out of a window shared by all layers are freed
        "window_freed_blocks_total": manager.num_window_freed_blocks,
        "device": pool_state(manager.block_pool),
        "host": pool_state(manager.host_pool) if manager.host_pool is not None else None,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "running": [request_state(r, manager) for r in scheduler.running[:MAX_LISTED_REQUESTS]],
        "waiting": [request_state(r, manager) for _, r in zip(range(MAX_LISTED_REQUESTS), scheduler.waiting)],
        "num_preemptions_total": scheduler.num_preemptions_total,
    }
