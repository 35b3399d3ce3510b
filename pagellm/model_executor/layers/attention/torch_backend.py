"""The PyTorch attention backend: the reference every device runs, and the prefill path the C backend shares.

Owns the PyTorch cache write (`reshape_and_cache`), the batched decode over `index_select`-gathered blocks masked to
each sequence's length (and the layer's sliding window), and the per-chunk prefill through
`scaled_dot_product_attention`. It runs where no kernel
does (other dtypes on the CPU, no compiler, no Triton) and when PAGELLM_ATTENTION_BACKEND=torch forces it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.model_executor.layers.attention.backend import AttentionBackend, AttentionMetadata, PrefillChunk


class TorchBackend(AttentionBackend):
    name = "torch"

    @classmethod
    def is_available(cls, device_type: str, dtype: torch.dtype) -> bool:
        return True  # the fallback: plain PyTorch runs everywhere

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None) -> torch.Tensor:
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        assert tables is not None and lens is not None, "metadata with decodes has their tables"
        batch, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[0]
        group = num_heads // num_kv_heads
        # Heads outermost: the gather lands as [Hkv, B, L, D], contiguous, so the matmuls need no transposing copy.
        keys = gather_blocks(key_cache, tables).to(q.dtype)
        values = gather_blocks(value_cache, tables).to(q.dtype)
        q = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(q, keys.transpose(2, 3)).float() * scale  # [Hkv, B, G, L]
        positions = torch.arange(keys.shape[2], device=q.device)
        hidden = positions >= lens[:, None]  # [B, L]: padding past each sequence's end
        if window is not None:  # the query, at position len - 1, sees keys after len - 1 - window
            hidden |= positions < lens[:, None] - window
        scores.masked_fill_(hidden[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values).transpose(0, 1).reshape(batch, num_heads, head_dim)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                window: int | None = None) -> None:
        # One SDPA call per chunk: no padding of the token dimension to batch them.
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = prefill_chunk(q[rows], k[rows], v[rows], key_cache, value_cache, chunk, scale, window)


def prefill_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                  window: int | None = None) -> torch.Tensor:
    """One chunk's causal attention to its own tokens and the earlier ones in the cache, each query within the last
    `window` tokens (None: all): q [Lq, H, D], k, v [Lq, Hkv, D] -> [Lq, H, D]."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    q = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
    first = 0  # position of the first key read
    if chunk.context_len == 0:
        # The whole sequence is in this chunk: attend to the fresh K/V, no cache read needed.
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
    else:
        assert chunk.block_ids is not None, "a chunk behind cached context reads its blocks"
        block_size = key_cache.shape[2]
        if window is not None:  # blocks wholly before the first query's window are not read
            first = max(0, chunk.context_len - window + 1) // block_size * block_size
        block_ids = chunk.block_ids[first // block_size:]
        keys = gather_blocks(key_cache, block_ids)[:, :chunk.seq_len - first].to(q.dtype)
        values = gather_blocks(value_cache, block_ids)[:, :chunk.seq_len - first].to(q.dtype)
    mask = None
    if chunk.context_len or window is not None:
        key_pos = torch.arange(first, chunk.seq_len, device=q.device)
        query_pos = torch.arange(chunk.context_len, chunk.seq_len, device=q.device)[:, None]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
    out = F.scaled_dot_product_attention(
        q, keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=num_heads != num_kv_heads)
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


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [Hkv, num_blocks, block_size, D], block_table [..., n] -> [Hkv, ..., n * block_size, D].

    index_select, not advanced indexing: it is 2-3x faster on CPU for this gather (measured)."""
    heads, _, block_size, dim = cache.shape
    gathered = cache.index_select(1, block_table.reshape(-1))
    return gathered.view(heads, *block_table.shape[:-1], block_table.shape[-1] * block_size, dim)
