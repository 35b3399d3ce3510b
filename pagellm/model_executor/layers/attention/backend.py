"""The contract every attention backend meets, and the metadata they all read.

Owns `AttentionBackend` (what the model runner and the `Attention` layer call: stage and build a step's metadata,
write K/V into the cache, attend over the flat batch), the base `AttentionMetadata` every backend accepts, and the
host-side `PrefillLayout` the model runner hands a backend to build it from. The flat batch is laid out decodes
first (one query token each), then prefill chunks; `forward` splits it the same way for every backend, so a backend
supplies only its cache write, its batched decode and its prefill.

Each call carries the layer's sliding window (`window`, None: the whole sequence): with a window of n a query at
position q sees the keys at positions q - n < k <= q, as transformers' sliding-window mask has it. A backend skips
reading the blocks wholly before a query's window, or reads them masked: the KV manager frees those blocks of a
sliding window's group and their table entries hold block 0 (see core/kv/kv_cache_manager.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from pagellm.model_executor.host_copy import StagedCopy


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset in the flat batch
    query_len: int
    context_len: int  # tokens of this sequence already in the cache before this chunk
    block_ids: torch.Tensor | None  # blocks covering context_len + query_len tokens (None: the backend batches them)

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass(slots=True)
class AttentionMetadata:
    """What every backend reads; a backend that needs more subclasses it (slots: built once per step, read per
    layer)."""

    slot_mapping: torch.Tensor  # [num_tokens]: flat cache slot of each token's K/V
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64, including the query token
    prefills: list[PrefillChunk]
    # Models with several KV cache groups (core/kv/kv_cache_groups.py): this metadata is the first group's, and
    # `kv_groups[g - 1]` group g's (its slot mapping and block tables); each `Attention` layer picks its own.
    kv_groups: list[AttentionMetadata] = field(default_factory=list, kw_only=True)


@dataclass(slots=True)
class PrefillLayout:
    """A step's prefill chunks on the host, in batch order: what a backend stages for the device."""

    query_starts: np.ndarray  # [chunks]: each chunk's first row in the flat batch
    query_lens: np.ndarray  # [chunks]
    context_lens: np.ndarray  # [chunks]: tokens of the sequence already in the cache
    block_tables: np.ndarray  # [chunks, max_blocks], padded with block 0
    block_ids: list[list[int]]  # each chunk's own blocks, unpadded


class AttentionBackend(ABC):
    """One way of running paged attention. Stateless: `select_backend` makes one per (device, dtype) and every
    layer shares it. Subclasses set `name` and the registry in `selector.py` lists them."""

    name: ClassVar[str]
    # Whether the fused CPU decoder (every layer of a decode step in one C call) may stand in for the layers: it
    # carries the C kernel's attention, so only the backend that attends the same way allows it.
    supports_fused_decoder: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def is_available(cls, device_type: str, dtype: torch.dtype) -> bool:
        """Whether this backend runs, and is the one to pick by default, for this device and compute dtype."""

    @classmethod
    def prepare(cls, device_type: str) -> None:
        """Set the process up for this backend on `device_type` before its kernels are first imported."""
        return None  # most backends need nothing

    def check_kv_cache_dtype(self, cache_dtype: torch.dtype, device: torch.device) -> None:
        """Raise at start-up (a ValueError saying why) if this backend cannot read a cache of `cache_dtype`."""
        return None  # most backends read every --kv-cache-dtype

    # ---- metadata: staged into the step's one host-to-device copy, then built from the copies ----------------
    def stage_prefills(self, staged: StagedCopy, layout: PrefillLayout) -> list[int]:
        """Queue what the prefill chunks need on the device; returns the handles `build_metadata` gets back as
        tensors. By default each chunk's own block table."""
        return [staged.add(ids) for ids in layout.block_ids]

    def build_metadata(self, slot_mapping: torch.Tensor, num_decodes: int, decode_block_tables: torch.Tensor | None,
                       decode_seq_lens: torch.Tensor | None, layout: PrefillLayout,
                       prefill_tensors: list[torch.Tensor]) -> AttentionMetadata:
        """The step's metadata from the device copies (`prefill_tensors`: what `stage_prefills` queued, in order)."""
        return AttentionMetadata(slot_mapping, num_decodes, decode_block_tables, decode_seq_lens,
                                 self._chunks(layout, prefill_tensors))

    @staticmethod
    def _chunks(layout: PrefillLayout, block_ids: list[torch.Tensor] | None) -> list[PrefillChunk]:
        return [PrefillChunk(query_start=int(layout.query_starts[j]), query_len=int(layout.query_lens[j]),
                             context_len=int(layout.context_lens[j]),
                             block_ids=None if block_ids is None else block_ids[j])
                for j in range(len(layout.query_lens))]

    # ---- attention ---------------------------------------------------------------------------------------
    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """key, value [T, Hkv, D] into their slots of caches [Hkv, num_blocks, block_size, D], rounded to the
        cache's type."""

    @abstractmethod
    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None) -> torch.Tensor:
        """The decodes' attention: q [num_decodes, H, D] -> [num_decodes, H, D], reading the cache through
        `meta.decode_block_tables`, each query seeing the last `window` tokens of its sequence (None: all)."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                window: int | None = None) -> None:
        """The prefill chunks' attention into their rows of `out` (q, k, v and out are the whole flat batch; the
        chunks' own K/V are already in the cache), causal within `window` (None: causal only)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, Hkv, num_blocks, block_size, D]. Returns [T, H * D]."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        if not meta.prefills:  # all decodes: the batched call's output is the whole output
            return self.decode(q, key_cache, value_cache, meta, scale, window).view(q.shape[0], -1)
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            out[:n] = self.decode(q[:n], key_cache, value_cache, meta, scale, window)
        self.prefill(q, k, v, key_cache, value_cache, meta, scale, out, window)
        return out.view(q.shape[0], q.shape[1] * q.shape[2])
