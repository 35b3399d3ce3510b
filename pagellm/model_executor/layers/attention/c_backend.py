"""The C attention backend: the CPU float32 default, on the kernels of `kernels/paged_attention.py`.

Owns the choice of the C cache write and the C batched decode, which read each sequence's blocks in place through
its block table. Prefill chunks take the PyTorch path (inherited from `TorchBackend`). It is the only backend whose
attention the fused CPU decoder reproduces, so the only one that lets it run.
"""
from __future__ import annotations

import torch

from pagellm.kernels import paged_attention as cpu_kernels
from pagellm.model_executor.layers.attention.backend import AttentionMetadata
from pagellm.model_executor.layers.attention.torch_backend import TorchBackend, reshape_and_cache


class CBackend(TorchBackend):
    name = "c"
    supports_fused_decoder = True

    @classmethod
    def is_available(cls, device_type: str, dtype: torch.dtype) -> bool:
        # The device is checked before the library is loaded, which compiles it the first time.
        return device_type == "cpu" and dtype == torch.float32 and cpu_kernels.load() is not None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # The C write takes any token stride but needs each head's row contiguous.
        if key.stride(-1) == 1 and value.stride(-1) == 1:
            cpu_kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        else:
            reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None) -> torch.Tensor:
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        assert tables is not None and lens is not None, "metadata with decodes has their tables"
        # The kernel reads the cache in place (no gathered copy of every sequence's K/V per layer), and only the
        # blocks that hold a query's window.
        return cpu_kernels.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale, window)
