"""PagedAttention over a flattened batch: K/V written into cache blocks by slot, read back by block table.

The batch is laid out decodes first (one query token each), then prefill chunks. Decodes run as one batched
attention that reads each sequence's blocks through its block table: the C kernel on CPU, the Triton kernel on
CUDA (`attention_backend`), or, where neither runs, PyTorch over gathered blocks masked to each length. Each prefill
chunk attends causally to its own tokens and to the earlier chunks already in the cache: on CUDA all chunks in one
Triton launch reading the cache through the block tables (`PrefillBatch`), elsewhere one SDPA call per chunk. No
padding of the token dimension anywhere. The cache may hold a narrower type than the model computes in
(`--kv-cache-dtype`): K and V are rounded to it when written and widened back when read.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagellm import envs
from pagellm.kernels import paged_attention as cpu_kernels


@dataclass
class PrefillChunk:
    query_start: int  # offset in the flat batch
    query_len: int
    context_len: int  # tokens of this sequence already in the cache before this chunk
    block_ids: torch.Tensor | None  # blocks covering context_len + query_len tokens (None: see prefill_batch)

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


PREFILL_BLOCK_M = 32  # queries per program of the Triton prefill kernel


@dataclass
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


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: flat cache slot of each token's K/V
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64, including the query token
    prefills: list[PrefillChunk]
    prefill_batch: PrefillBatch | None = None  # the same chunks, for the Triton backend


@cache
def attention_backend(device_type: str, dtype: torch.dtype) -> str:
    """'c' (CPU float32 with the C kernel built), 'triton' (CUDA with Triton installed), else 'torch';
    PAGELLM_ATTENTION_BACKEND overrides the choice."""
    forced = envs.attention_backend()
    if forced == "triton":
        if device_type == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined, on import
        return "triton"
    if forced == "torch":
        return "torch"
    if device_type == "cpu":
        return "c" if dtype == torch.float32 and cpu_kernels.load() is not None else "torch"
    # CUDA builds of torch bring Triton along.
    return "triton" if device_type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"


def check_kv_cache_dtype(cache_dtype: torch.dtype, model_dtype: torch.dtype, device: torch.device) -> None:
    """Fail at start-up rather than at the first decode: Triton compiles e4m3 (float8_e4m3fn) loads only for GPUs of
    compute capability 8.9 or newer (Ada, Hopper), e5m2 everywhere."""
    if (device.type == "cuda" and cache_dtype == torch.float8_e4m3fn
            and attention_backend("cuda", model_dtype) == "triton"):
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"--kv-cache-dtype fp8 (e4m3) needs a GPU of compute capability 8.9 or newer (Ada, "
                             f"Hopper) for the Triton attention kernels; this one is {capability[0]}.{capability[1]}. "
                             f"Use --kv-cache-dtype fp8_e5m2 or float16.")


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, Hkv, num_blocks, block_size, D]. Returns [T, H * D]."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        backend = attention_backend(q.device.type, q.dtype)
        if backend == "c" and k.stride(-1) == 1 and v.stride(-1) == 1:
            cpu_kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        else:
            reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        if not meta.prefills:  # all decodes: the batched call's output is the whole output
            return self._decode(q, key_cache, value_cache, meta, backend).view(q.shape[0], -1)
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            out[:n] = self._decode(q[:n], key_cache, value_cache, meta, backend)
        if meta.prefill_batch is not None:
            from pagellm.kernels import triton_attention

            batch = meta.prefill_batch
            out[n:] = triton_attention.paged_prefill_attention(
                q[n:], key_cache, value_cache, batch.block_tables, batch.query_starts, batch.query_lens,
                batch.context_lens, batch.tile_chunks, batch.tile_starts, self.scale, PREFILL_BLOCK_M)
            return out.view(q.shape[0], self.num_heads * self.head_dim)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], key_cache, value_cache, chunk)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                backend: str) -> torch.Tensor:
        # The kernels read the cache in place: no gathered copy of every sequence's K/V per layer.
        if backend == "c":
            return cpu_kernels.paged_decode_attention(q, key_cache, value_cache, meta.decode_block_tables,
                                                      meta.decode_seq_lens, self.scale)
        if backend == "triton":
            from pagellm.kernels import triton_attention  # imported where it runs (it defines the Triton kernels)

            return triton_attention.paged_decode_attention(q, key_cache, value_cache, meta.decode_block_tables,
                                                           meta.decode_seq_lens, self.scale)
        batch = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        # Heads outermost: the gather lands as [Hkv, B, L, D], contiguous, so the matmuls need no transposing copy.
        keys = _gather_blocks(key_cache, meta.decode_block_tables).to(q.dtype)
        values = _gather_blocks(value_cache, meta.decode_block_tables).to(q.dtype)
        q = q.view(batch, self.num_kv_heads, group, self.head_dim).transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(q, keys.transpose(2, 3)).float() * self.scale  # [Hkv, B, G, L]
        padding = torch.arange(keys.shape[2], device=q.device) >= meta.decode_seq_lens[:, None]  # [B, L]
        scores.masked_fill_(padding[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values).transpose(0, 1).reshape(batch, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        if chunk.context_len == 0:
            # The whole sequence is in this chunk: attend to the fresh K/V, no cache read needed.
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            keys = _gather_blocks(key_cache, chunk.block_ids)[:, :chunk.seq_len].to(q.dtype)
            values = _gather_blocks(value_cache, chunk.block_ids)[:, :chunk.seq_len].to(q.dtype)
            key_pos = torch.arange(chunk.seq_len, device=q.device)
            query_pos = torch.arange(chunk.context_len, chunk.seq_len, device=q.device)
            mask, causal = key_pos[None, :] <= query_pos[:, None], False
        out = F.scaled_dot_product_attention(
            q, keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(0).transpose(0, 1)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """The C kernel's cache write in PyTorch: key, value [T, Hkv, D] into their slots of caches [Hkv, num_blocks,
    block_size, D], rounded to the cache's type (--kv-cache-dtype may make it narrower than the model's); 8-bit
    floats saturate at their largest finite value rather than overflow, as the C kernel and vLLM's cache writes do
    (torch's e5m2 conversion would give infinity)."""
    for kv_cache, fresh in ((key_cache, key), (value_cache, value)):
        slots, fresh = kv_cache.view(kv_cache.shape[0], -1, kv_cache.shape[-1]), fresh.transpose(0, 1)
        if kv_cache.dtype.itemsize == 1:  # index_copy_ has no 8-bit float kernel: copy their bytes
            limit = torch.finfo(kv_cache.dtype).max
            fresh = fresh.clamp(-limit, limit).to(kv_cache.dtype).contiguous().view(torch.uint8)
            slots = slots.view(torch.uint8)
        slots.index_copy_(1, slot_mapping, fresh.to(slots.dtype))


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [Hkv, num_blocks, block_size, D], block_table [..., n] -> [Hkv, ..., n * block_size, D].

    index_select, not advanced indexing: it is 2-3x faster on CPU for this gather (measured)."""
    heads, _, block_size, dim = cache.shape
    gathered = cache.index_select(1, block_table.reshape(-1))
    return gathered.view(heads, *block_table.shape[:-1], block_table.shape[-1] * block_size, dim)
