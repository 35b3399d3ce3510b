"""The KV cache tensors: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer,
allocated once at start-up."""
from __future__ import annotations

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
        shape = (2, num_blocks, cache_config.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=model_config.dtype, device=device)
                          for _ in range(model_config.num_layers)]
