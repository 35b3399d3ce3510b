"""The KV cache tensors: zero-filled at start, copy_blocks (copy-on-write) copies whole blocks in order, and the
host tier: swap_out / swap_in move exact block contents, in the step's order, with one gather and one scatter per
layer whatever the number of blocks."""
from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagellm.config import CacheConfig
from pagellm.worker.cache_engine import CacheEngine


def make_cache(num_blocks: int = 5, layers: int = 3, num_host_blocks: int = 0, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> CacheEngine:
    model_config = SimpleNamespace(get_num_kv_heads=lambda tp=1: 2, head_dim=4, num_layers=layers, dtype=dtype)
    cache_config = CacheConfig(block_size=2)
    return CacheEngine(model_config, cache_config, num_blocks, torch.device(device), num_host_blocks)


def fill_random(caches: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Random contents in every layer; returns copies of what was written."""
    generator = torch.Generator().manual_seed(seed)
    for kv in caches:
        kv.copy_(torch.randn(kv.shape, generator=generator).to(kv.dtype))
    return [kv.cpu().clone() for kv in caches]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it, by name without overload (index_select, index_copy_, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


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


def test_host_pool_has_the_device_layout_and_starts_zeroed():
    cache = make_cache(num_blocks=5, num_host_blocks=7)
    assert len(cache.host_caches) == 3
    for kv in cache.host_caches:
        assert kv.shape == (2, 2, 7, 2, 4) and kv.device.type == "cpu" and not kv.any()


def test_no_host_blocks_means_no_host_pool():
    cache = make_cache(num_host_blocks=0)
    assert cache.host_caches == []
    cache.swap_out([])
    cache.swap_in([])
    with pytest.raises(ValueError, match="no host blocks"):
        cache.swap_out([(0, 0)])
    with pytest.raises(ValueError, match="no host blocks"):
        cache.swap_in([(0, 0)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_swap_out_then_in_round_trips_random_non_contiguous_blocks(dtype, same_bytes):
    cache = make_cache(num_blocks=12, layers=4, num_host_blocks=10, dtype=dtype)
    device_before = fill_random(cache.kv_caches, seed=0)
    rng = random.Random(0)
    sources = rng.sample(range(12), 5)
    host_ids = rng.sample(range(10), 5)
    cache.swap_out(list(zip(sources, host_ids)))
    for host_kv, old in zip(cache.host_caches, device_before):
        for src, host in zip(sources, host_ids):
            assert same_bytes(host_kv[:, :, host], old[:, :, src])
        others = [h for h in range(10) if h not in host_ids]
        assert not host_kv[:, :, others].any()

    # Overwrite the device cache (the blocks were reused), then bring the blocks back to other places.
    fill_random(cache.kv_caches, seed=1)
    destinations = rng.sample(range(12), 5)
    device_mid = [kv.clone() for kv in cache.kv_caches]
    cache.swap_in(list(zip(host_ids, destinations)))
    for kv, old, mid in zip(cache.kv_caches, device_before, device_mid):
        for src, dst in zip(sources, destinations):
            assert same_bytes(kv[:, :, dst], old[:, :, src])
        untouched = [b for b in range(12) if b not in destinations]
        assert same_bytes(kv[:, :, untouched], mid[:, :, untouched])


def test_a_block_evicted_and_reused_in_one_step_ends_with_the_swapped_in_contents():
    cache = make_cache(num_blocks=4, layers=2, num_host_blocks=3)
    device_before = fill_random(cache.kv_caches, seed=0)
    host_before = fill_random(cache.host_caches, seed=1)
    # Device block 2 goes out to host block 0 while host block 1 comes into device block 2, as the worker applies
    # a step: swap-out first, then swap-in.
    cache.swap_out([(2, 0)])
    cache.swap_in([(1, 2)])
    for kv, host_kv, old_kv, old_host in zip(cache.kv_caches, cache.host_caches, device_before, host_before):
        assert torch.equal(host_kv[:, :, 0], old_kv[:, :, 2])
        assert torch.equal(kv[:, :, 2], old_host[:, :, 1])
        assert torch.equal(kv[:, :, [0, 1, 3]], old_kv[:, :, [0, 1, 3]])
        assert torch.equal(host_kv[:, :, [1, 2]], old_host[:, :, [1, 2]])


@pytest.mark.parametrize("num_pairs", [1, 6])
def test_swaps_are_one_gather_and_one_scatter_per_layer(num_pairs):
    layers = 3
    cache = make_cache(num_blocks=8, layers=layers, num_host_blocks=8)
    pairs = [(block, 7 - block) for block in range(num_pairs)]
    for swap in (cache.swap_out, cache.swap_in):
        with OpCounter() as ops:
            swap(pairs)
        assert ops.counts["index_select"] == layers and ops.counts["index_copy_"] == layers
        assert ops.counts["copy_"] == 0  # no per-block copies


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swaps_round_trip_on_cuda_through_pinned_memory():
    cache = make_cache(num_blocks=6, layers=2, num_host_blocks=5, dtype=torch.bfloat16, device="cuda")
    assert all(kv.is_pinned() for kv in cache.host_caches)
    device_before = fill_random(cache.kv_caches, seed=0)
    cache.swap_out([(4, 0), (1, 3)])
    cache.kv_caches[0].zero_()
    cache.kv_caches[1].zero_()
    cache.swap_in([(3, 5), (0, 2)])
    torch.cuda.current_stream().synchronize()
    for kv, old in zip(cache.kv_caches, device_before):
        assert torch.equal(kv[:, :, 5].cpu(), old[:, :, 1])
        assert torch.equal(kv[:, :, 2].cpu(), old[:, :, 4])


def test_kv_cache_groups_share_a_tensor_per_position_and_move_each_once():
    """Four layers in two KV cache groups of two (layers 0 and 2 at position 0, 1 and 3 at position 1): two
    tensors, each layer's entry the tensor of its position; a swap round trip and a copy move each tensor's block
    once and exactly."""
    model_config = SimpleNamespace(get_num_kv_heads=lambda tp=1: 2, head_dim=4, num_layers=4, dtype=torch.float32)
    cache = CacheEngine(model_config, CacheConfig(block_size=2), 5, torch.device("cpu"), num_host_blocks=4,
                        layer_tensors=[0, 1, 0, 1])
    assert len(cache.tensors) == 2 and len(cache.host_caches) == 2
    assert cache.kv_caches[0] is cache.kv_caches[2] is cache.tensors[0]
    assert cache.kv_caches[1] is cache.kv_caches[3] is cache.tensors[1]
    written = fill_random(cache.tensors, seed=3)
    with OpCounter() as ops:
        cache.swap_out([(2, 0), (4, 1)])
    assert ops.counts["index_select"] == 2 and ops.counts["index_copy_"] == 2
    for kv in cache.tensors:
        kv.zero_()
    cache.swap_in([(0, 1), (1, 3)])
    cache.copy_blocks([(1, 0)])
    for old, kv in zip(written, cache.tensors):
        assert torch.equal(kv[:, :, 1], old[:, :, 2]) and torch.equal(kv[:, :, 3], old[:, :, 4])
        assert torch.equal(kv[:, :, 0], old[:, :, 2])
