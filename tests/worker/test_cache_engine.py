"""The KV cache tensors: zero-filled at start, and copy_blocks (copy-on-write) copies whole blocks in order."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from pagellm.worker.cache_engine import CacheEngine


def make_cache(num_blocks: int = 5, layers: int = 3) -> CacheEngine:
    model_config = SimpleNamespace(num_kv_heads=2, head_dim=4, num_layers=layers, dtype=torch.float32)
    cache_config = SimpleNamespace(block_size=2)
    return CacheEngine(model_config, cache_config, num_blocks, torch.device("cpu"))


def test_cache_starts_zeroed_with_heads_outermost():
    cache = make_cache()
    assert len(cache.kv_caches) == 3
    for kv in cache.kv_caches:
        assert kv.shape == (2, 2, 5, 2, 4) and not kv.any()


def test_copy_blocks_copies_every_layer_in_order():
    cache = make_cache()
    for layer, kv in enumerate(cache.kv_caches):
        kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view_as(kv) + 1000 * layer)
    before = [kv.clone() for kv in cache.kv_caches]
    # Block 1 is copied to 3; then block 4 overwrites block 1 (a later copy may reuse an earlier source).
    cache.copy_blocks([(1, 3), (4, 1)])
    for old, kv in zip(before, cache.kv_caches):
        assert torch.equal(kv[:, :, 3], old[:, :, 1])
        assert torch.equal(kv[:, :, 1], old[:, :, 4])
        for untouched in (0, 2, 4):
            assert torch.equal(kv[:, :, untouched], old[:, :, untouched])
