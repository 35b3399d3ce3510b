"""EngineArgs: the user-facing knobs (shared by `LLM(...)` and the CLI), turned into a validated EngineConfig."""
from __future__ import annotations

import os
from dataclasses import dataclass

from pagellm.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_device,
                            resolve_dtype)
from pagellm.model_executor.model_loader.resolve import DEFAULT_MODEL_NAME, resolve_model_dir
from pagellm.model_executor.models.registry import resolve_architecture


@dataclass
class EngineArgs:
    model: str | os.PathLike | None = None
    tokenizer: str | os.PathLike | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    served_model_name: str | None = None

    def create_engine_config(self) -> EngineConfig:
        from transformers import AutoConfig

        device = resolve_device(self.device)
        model_dir = resolve_model_dir(self.model)
        hf_config = AutoConfig.from_pretrained(str(model_dir))
        architecture = resolve_architecture(hf_config)
        max_model_len = self._max_model_len(hf_config)
        model_config = ModelConfig(
            model=str(model_dir),
            tokenizer=str(self.tokenizer or model_dir),
            hf_config=hf_config,
            architecture=architecture,
            dtype=resolve_dtype(self.dtype, device),
            max_model_len=max_model_len,
            seed=self.seed,
            served_model_name=self.served_model_name or (str(self.model) if self.model else DEFAULT_MODEL_NAME),
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(self.block_size, self.kv_cache_memory_bytes, self.gpu_memory_utilization),
            scheduler_config=SchedulerConfig(max_model_len, self.max_num_seqs, self.max_num_batched_tokens,
                                             self.enable_chunked_prefill),
            device_config=DeviceConfig(device),
        )

    def _max_model_len(self, hf_config) -> int:
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            # Sliding-window attention is not implemented; within the window it is plain causal attention.
            limit = min(limit, window)
        if self.max_model_len is None:
            return limit
        if not 0 < self.max_model_len <= limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be between 1 and the model's limit of "
                             f"{limit} tokens (max_position_embeddings, or the sliding window); lower "
                             f"--max-model-len.")
        return self.max_model_len
