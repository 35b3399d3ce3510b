"""The KV cache tensors: one [2, num_kv_heads, num_blocks, block_size, head_dim] tensor per layer, allocated
once at start-up. Heads are outermost so that gathering a batch's blocks yields [heads, batch, tokens, dim]
directly in the layout attention's matmuls want."""
from __future__ import annotations

import math
import mmap

import torch

from pagellm.config import CacheConfig, ModelConfig


def kv_bytes_per_block(model_config: ModelConfig, block_size: int) -> int:
    element_size = torch.tensor([], dtype=model_config.dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * element_size


class CacheEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, num_blocks: int,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = cache_config.block_size
        shape = (2, model_config.num_kv_heads, num_blocks, cache_config.block_size, model_config.head_dim)
        self.kv_caches = [zeros(shape, model_config.dtype, device) for _ in range(model_config.num_layers)]

    @torch.inference_mode()
    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy each (source, destination) block in every layer, in order (a block freed by one
        copy's owner may be the destination of a later one in the same step)."""
        for kv in self.kv_caches:
            for src, dst in blocks_to_copy:
                kv[:, :, dst].copy_(kv[:, :, src])


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
