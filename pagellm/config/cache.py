"""The KV cache: `CacheConfig` (block size, memory, prefix caching, the host-memory tier) and the element types
it may hold (`KV_CACHE_DTYPES`)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# Halving the cache's bytes (float16, bfloat16) doubles the tokens it holds and halves what decode attention reads;
# K and V are then rounded, so outputs are no longer exactly those of the model's dtype. The 8-bit floats (vLLM's
# names; "fp8" is e4m3) quarter a float32 cache, unscaled and saturating at the type's largest finite value.
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                   "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(kw_only=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: derived from free memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 4 << 30  # the host-memory block tier (swap-out and second-level prefix cache)
    cache_dtype: str = "auto"  # the KV cache's element type, a KV_CACHE_DTYPES key ("auto": the model's dtype)

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return KV_CACHE_DTYPES[self.cache_dtype] or model_dtype

    def metrics_info(self, model_dtype: torch.dtype) -> dict[str, str]:
        """Every setting as a string, and the element type the cache holds (`kv_dtype`, what "auto" resolves to):
        the labels of /metrics' `cache_config_info`, as vLLM exports its cache config."""
        info = {setting.name: str(getattr(self, setting.name)) for setting in fields(self)}
        info["kv_dtype"] = str(self.kv_dtype(model_dtype)).removeprefix("torch.")
        return info

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}; "
                             f"fix --kv-cache-dtype.")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space must not be negative, got {self.swap_space_bytes} bytes; fix --swap-space.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
