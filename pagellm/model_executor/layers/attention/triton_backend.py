"""The Triton attention backend: the CUDA default, on the kernels of `kernels/triton_attention.py`.

Owns `TritonAttentionMetadata`, whose `PrefillBatch` lets one launch run every prefill chunk of a step reading the
cache through the block tables (built once per step by the model runner, not per layer), and the batched decode
kernel. Forced on the CPU (PAGELLM_ATTENTION_BACKEND=triton) it runs under Triton's interpreter: how the tests run
the CUDA kernels without a GPU. The kernel module is imported only where it runs (importing it defines the kernels).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.model_executor.host_copy import StagedCopy
from pagellm.model_executor.layers.attention.backend import AttentionMetadata, PrefillLayout
from pagellm.model_executor.layers.attention.torch_backend import TorchBackend

PREFILL_BLOCK_M = 32  # queries per program of the Triton prefill kernel


@dataclass(slots=True)
class PrefillBatch:
    """A step's prefill chunks as flat integer tensors, for the Triton kernel that runs them all in one launch."""

    block_tables: torch.Tensor  # [chunks, max_blocks], padded with block 0
    query_starts: torch.Tensor  # [chunks]: first query row of each chunk, counted from the first prefill row
    query_lens: torch.Tensor  # [chunks]
    context_lens: torch.Tensor  # [chunks]
    tile_chunks: torch.Tensor  # [tiles]: the chunk of each tile of PREFILL_BLOCK_M queries
    tile_starts: torch.Tensor  # [tiles]: the tile's first query, counted from its chunk's first

    @staticmethod
    def host_arrays(block_tables: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray) -> list[np.ndarray]:
        """The fields, in order, as host arrays, from the chunks' padded block tables, query and context lengths
        (the caller copies them to the device and builds the PrefillBatch from the copies)."""
        query_starts = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
        tiles_per_chunk = -(-query_lens // PREFILL_BLOCK_M)
        tile_chunks = np.repeat(np.arange(len(query_lens)), tiles_per_chunk)
        first_tile = np.concatenate(([0], np.cumsum(tiles_per_chunk)[:-1]))
        tile_starts = (np.arange(len(tile_chunks)) - first_tile[tile_chunks]) * PREFILL_BLOCK_M
        return [block_tables, query_starts, query_lens, context_lens, tile_chunks, tile_starts]


@dataclass(slots=True)
class TritonAttentionMetadata(AttentionMetadata):
    prefill_batch: PrefillBatch | None = None  # the prefill chunks, for the one-launch prefill kernel


class TritonBackend(TorchBackend):
    name = "triton"

    @classmethod
    def is_available(cls, device_type: str, dtype: torch.dtype) -> bool:
        # CUDA builds of torch bring Triton along.
        return device_type == "cuda" and importlib.util.find_spec("triton") is not None

    @classmethod
    def prepare(cls, device_type: str) -> None:
        if device_type == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined, on import

    def check_kv_cache_dtype(self, cache_dtype: torch.dtype, device: torch.device) -> None:
        # Triton compiles e4m3 (float8_e4m3fn) loads only for GPUs of compute capability 8.9 or newer (Ada,
        # Hopper), e5m2 everywhere; the interpreter on the CPU reads both.
        if device.type == "cuda" and cache_dtype == torch.float8_e4m3fn:
            capability = torch.cuda.get_device_capability(device)
            if capability < (8, 9):
                raise ValueError(
                    f"--kv-cache-dtype fp8 (e4m3) needs a GPU of compute capability 8.9 or newer (Ada, Hopper) for "
                    f"the Triton attention kernels; this one is {capability[0]}.{capability[1]}. Use "
                    f"--kv-cache-dtype fp8_e5m2 or float16.")

    def stage_prefills(self, staged: StagedCopy, layout: PrefillLayout) -> list[int]:
        if not len(layout.query_lens):
            return []
        return [staged.add(a) for a in PrefillBatch.host_arrays(layout.block_tables, layout.query_lens,
                                                                layout.context_lens)]

    def build_metadata(self, slot_mapping: torch.Tensor, num_decodes: int, decode_block_tables: torch.Tensor | None,
                       decode_seq_lens: torch.Tensor | None, layout: PrefillLayout,
                       prefill_tensors: list[torch.Tensor]) -> TritonAttentionMetadata:
        # The chunks keep their offsets and lengths (for forward's split) but no tables: the PrefillBatch has them.
        return TritonAttentionMetadata(slot_mapping, num_decodes, decode_block_tables, decode_seq_lens,
                                       self._chunks(layout, None),
                                       PrefillBatch(*prefill_tensors) if prefill_tensors else None)

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None) -> torch.Tensor:
        from pagellm.kernels import triton_attention

        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        assert tables is not None and lens is not None, "metadata with decodes has their tables"
        return triton_attention.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale, window)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                window: int | None = None) -> None:
        batch = meta.prefill_batch if isinstance(meta, TritonAttentionMetadata) else None
        if batch is None:  # metadata built without the batch (by hand, in tests): one SDPA call per chunk
            super().prefill(q, k, v, key_cache, value_cache, meta, scale, out, window)
            return
        from pagellm.kernels import triton_attention

        n = meta.num_decodes
        out[n:] = triton_attention.paged_prefill_attention(
            q[n:], key_cache, value_cache, batch.block_tables, batch.query_starts, batch.query_lens,
            batch.context_lens, batch.tile_chunks, batch.tile_starts, scale, PREFILL_BLOCK_M, window)
