"""Engine configuration: one dataclass per concern, validated once when built, and built with keywords only.
One default per setting, defined once here; `EngineArgs` reads them."""
from __future__ import annotations

from pagellm.config.cache import KV_CACHE_DTYPES, CacheConfig
from pagellm.config.engine import EngineConfig, LoRAConfig, StructuredOutputsConfig
from pagellm.config.model import (
    POOLING_TYPES,
    RUNNERS,
    DeviceConfig,
    ModelConfig,
    PoolerConfig,
    resolve_device,
    resolve_dtype,
)
from pagellm.config.parallel import DISTRIBUTED_EXECUTOR_BACKENDS, ParallelConfig
from pagellm.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from pagellm.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig

__all__ = [
    "DISTRIBUTED_EXECUTOR_BACKENDS", "KV_CACHE_DTYPES", "POOLING_TYPES", "PREEMPTION_MODES", "RUNNERS",
    "SCHEDULING_POLICIES", "SPECULATIVE_METHODS", "CacheConfig", "DeviceConfig", "EngineConfig", "LoRAConfig",
    "ModelConfig", "ParallelConfig", "PoolerConfig", "SchedulerConfig", "SpeculativeConfig",
    "StructuredOutputsConfig", "resolve_device", "resolve_dtype",
]
