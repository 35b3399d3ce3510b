"""The KV cache tensors, on the device and in the host tier, and the block moves between them.

Each cache tensor is one [2, num_kv_heads, num_blocks, block_size, head_dim] tensor, allocated once at start-up:
one per layer, or, for a model with several KV cache groups (core/kv/kv_cache_groups.py), one per position in a
group, shared by the layers at that position of every group (a block id is one page of a group's layers, whichever
group holds it; `kv_caches` lists each layer's tensor). Heads are outermost so that gathering a batch's blocks
yields [heads, batch, tokens, dim] directly in the layout attention's matmuls want. The host tier is
`num_host_blocks` blocks per tensor in the same layout (none when it is 0), in host memory: pinned on CUDA so that
transfers are true asynchronous DMA.

`swap_out` copies (device block, host block) pairs to the host, `swap_in` copies (host block, device block)
pairs back, and `copy_blocks` copies device blocks (copy-on-write). A swap moves all of its step's blocks with
one gather and one scatter per layer (index_select / index_copy_ along the block dimension, the scatter over the
cache's bytes so that every cache type takes it): a copy per block would cost a Python call and a kernel launch or
a small DMA for each block.

On CUDA the swaps run on a dedicated stream. That stream first waits for the compute stream (a swap must not
read a block before the forward pass that writes it, nor overwrite one a forward pass still reads), and the
compute stream then waits on an event recorded after the swap, so the next copy_blocks and forward pass see the
moved blocks without the host waiting for the transfer. The device side of a swap (gather, scatter) runs on the
GPU; the host side runs on the CPU, so:
- swap_in gathers the host blocks into pinned staging on the CPU, then the copy to the device (non_blocking)
  and the scatter there are queued on the swap stream; the host returns at once;
- swap_out gathers on the device and copies the result into pinned staging (non_blocking), but the host must
  wait for that transfer before it scatters the bytes into the pool. The engine already waits for each step's
  sampled tokens, so this waits for the swap's own transfer only, not for a forward pass.
"""
from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Iterator

import torch

from pagellm.config import CacheConfig, ModelConfig
from pagellm.model_executor.host_copy import tensor_on


def kv_bytes_per_block(model_config: ModelConfig, cache_config: CacheConfig, tensor_parallel_size: int = 1,
                       num_layers: int | None = None) -> int:
    """Bytes of one block on one rank (a tensor-parallel rank caches only its KV heads, a pipeline stage only its
    `num_layers` layers; None: every layer)."""
    element_size = cache_config.kv_dtype(model_config.dtype).itemsize
    num_kv_heads = model_config.get_num_kv_heads(tensor_parallel_size)
    num_layers = model_config.num_layers if num_layers is None else num_layers
    return 2 * num_layers * cache_config.block_size * num_kv_heads * model_config.head_dim * element_size


class CacheEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, num_blocks: int,
                 device: torch.device, num_host_blocks: int = 0, tensor_parallel_size: int = 1,
                 num_layers: int | None = None, layer_tensors: list[int] | None = None) -> None:
        """`layer_tensors`: the cache tensor of each of this stage's layers (None: one tensor per layer)."""
        self.num_kv_heads = model_config.get_num_kv_heads(tensor_parallel_size)
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = cache_config.block_size
        self.device = device
        # A pipeline stage caches its own layers only (`num_layers`; None: every layer).
        dtype = cache_config.kv_dtype(model_config.dtype)
        layer_tensors = layer_tensors or list(range(model_config.num_layers if num_layers is None else num_layers))
        tensors = range(max(layer_tensors) + 1)
        # The distinct tensors: swaps and copies move each block once.
        self.tensors = [zeros(self._shape(model_config, num_blocks), dtype, device) for _ in tensors]
        self.kv_caches = [self.tensors[t] for t in layer_tensors]
        host_shape = self._shape(model_config, num_host_blocks)
        self.host_caches = [host_zeros(host_shape, dtype, device) for _ in tensors] if num_host_blocks else []
        self._on_cuda = device.type == "cuda"
        self._swap_stream = torch.cuda.Stream(device) if self._on_cuda and num_host_blocks else None
        self._swap_done = torch.cuda.Event() if self._swap_stream is not None else None

    def _shape(self, model_config: ModelConfig, num_blocks: int) -> tuple[int, ...]:
        return 2, self.num_kv_heads, num_blocks, self.block_size, model_config.head_dim

    @torch.inference_mode()
    def swap_out(self, blocks_to_swap_out: list[tuple[int, int]]) -> None:
        """Copy each (device block, host block) pair's device block into the host block, in every layer."""
        if not blocks_to_swap_out:
            return
        self._require_host_pool()
        device_ids, host_ids = zip(*blocks_to_swap_out)
        with self._on_swap_stream():
            device_index = tensor_on(device_ids, torch.int64, self.device)  # once per swap, for every layer
            gathered = [self._to_host(kv.index_select(2, device_index)) for kv in self.tensors]
        if self._on_cuda:
            self._swap_done.synchronize()  # the CPU scatter below reads what the transfers wrote
        host_index = torch.tensor(host_ids)
        for host_kv, blocks in zip(self.host_caches, gathered):
            as_bytes(host_kv).index_copy_(2, host_index, as_bytes(blocks))

    @torch.inference_mode()
    def swap_in(self, blocks_to_swap_in: list[tuple[int, int]]) -> None:
        """Copy each (host block, device block) pair's host block into the device block, in every layer."""
        if not blocks_to_swap_in:
            return
        self._require_host_pool()
        host_ids, device_ids = zip(*blocks_to_swap_in)
        host_index = torch.tensor(host_ids)
        staged = [gather_blocks(host_kv, host_index, pin=self._on_cuda) for host_kv in self.host_caches]
        with self._on_swap_stream():
            device_index = tensor_on(device_ids, torch.int64, self.device)  # once per swap, for every layer
            for kv, blocks in zip(self.tensors, staged):
                as_bytes(kv).index_copy_(2, device_index, as_bytes(blocks.to(self.device, non_blocking=True)))

    @torch.inference_mode()
    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy each (source, destination) block in every layer, in order (a block freed by one
        copy's owner may be the destination of a later one in the same step)."""
        for kv in self.tensors:
            for src, dst in blocks_to_copy:
                kv[:, :, dst].copy_(kv[:, :, src])

    def _require_host_pool(self) -> None:
        if not self.num_host_blocks:
            raise ValueError("A swap was requested, but this cache has no host blocks (swap_space is 0).")

    def _to_host(self, blocks: torch.Tensor) -> torch.Tensor:
        """Device blocks copied into pinned host staging, asynchronously (on CPU they are already there)."""
        if not self._on_cuda:
            return blocks
        staging = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        return staging.copy_(blocks, non_blocking=True)

    @contextlib.contextmanager
    def _on_swap_stream(self) -> Iterator[None]:
        """Queue the enclosed work on the swap stream, after the compute stream's work so far and before its work
        from now on. The ordering is an event the compute stream waits on: the host does not wait."""
        if self._swap_stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        self._swap_stream.wait_stream(compute)
        with torch.cuda.stream(self._swap_stream):
            yield
        self._swap_done.record(self._swap_stream)
        compute.wait_event(self._swap_done)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache's memory as bytes, for the scatters: index_copy_ has no 8-bit float kernel."""
    return cache.view(torch.uint8)


def gather_blocks(cache: torch.Tensor, index: torch.Tensor, pin: bool) -> torch.Tensor:
    """The blocks of a host cache at `index` as one new tensor, pinned when a GPU copies it asynchronously."""
    shape = (*cache.shape[:2], len(index), *cache.shape[3:])
    out = torch.empty(shape, dtype=cache.dtype, pin_memory=pin)
    return torch.index_select(cache, 2, index, out=out)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-filled host-tier memory: lazily zeroed like the device cache on CPU; pinned once, up front, on CUDA."""
    if device.type == "cpu":
        return zeros(shape, dtype, device)
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-filled cache memory. The cache must start as zeros, not garbage: padded decode slots are multiplied
    by a zero probability, and 0 * NaN would poison the output. On CPU an anonymous mapping is zero by definition
    and the OS fills its pages on first touch, so a multi-GiB pool costs nothing until it is used (and does not
    depend on how malloc is tuned)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, max(num_bytes, 1))
    # frombuffer keeps `memory` alive for as long as the tensor lives.
    return torch.frombuffer(memory, dtype=torch.uint8, count=num_bytes).view(dtype).view(shape)
