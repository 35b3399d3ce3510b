"""The KV-cache half of core/: physical blocks and their pools (block_pool.py), prefix-cache keys (block_hash.py)
and the block tables over the device and host tiers (kv_cache_manager.py). Nothing here knows the scheduler."""
