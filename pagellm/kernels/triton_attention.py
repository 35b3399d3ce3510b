"""Paged attention in Triton for CUDA: each query reads its sequence's K/V through its block table, in place.

Decode:
One program handles one (sequence, kv head, split) triple: the query heads that share the kv head (GQA) are the
rows of one `tl.dot`, so each K/V tile is read once for the whole group. The sequence's tokens are walked in
tiles of BLOCK_N with an online softmax; a tile's tokens may span several cache blocks (each token looks up its
own block), so any block size works. When there are too few (sequence, kv head) pairs to fill the GPU, the
sequence is also split into partitions (flash-decoding) whose partial results a second kernel merges by their
log-sum-exp.

Prefill: every prompt chunk of a step in one launch, one program per (tile of BLOCK_M queries of one chunk, query
head), walking the sequence's keys up to the tile's last query position (causal) through the block table. A later
chunk of a chunked prefill, or a prompt whose prefix came from the cache, reads that context in place like its own
fresh K/V, with no gathered copy. Products run in float32 as in decode (bf16 inputs on tensor cores would be faster
for this compute-bound part; measuring that needs a GPU).

Both take the layer's sliding window (`window`, None: the whole sequence): a query at position q sees keys
q - window < k <= q, and the tiles before the first query's window are not read.

Imported only where it runs: on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before
this module is imported), which is how the tests check it on machines without a GPU.
"""
from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # tokens per tile: tl.dot needs at least 16
MIN_PARTITION = 256  # tokens: shorter partitions cost more in the merge than they gain in parallelism
NO_WINDOW = 1 << 30  # the window passed for a layer without one: past any sequence, and lower bounds stay in int32


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, table, cache_base, tokens, end, lowers, limits, dims, dim_mask,
                 block_size, stride_cb, stride_cs, scale, PRECISION: tl.constexpr):
    """One tile of keys (`tokens`, read through the block `table`) folded into the rows' online softmax: running
    max `m_i`, sum `l_i` and output `acc`. Row r sees the tile's keys before `end` from `lowers[r]` up to
    `limits[r]`."""
    valid = tokens < end
    blocks = tl.load(table + tokens // block_size, mask=valid, other=0)
    offsets = cache_base + blocks.to(tl.int64) * stride_cb + (tokens % block_size) * stride_cs
    kv_mask = valid[:, None] & dim_mask[None, :]
    k = tl.load(k_cache + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    seen = valid[None, :] & (tokens[None, :] >= lowers[:, None]) & (tokens[None, :] <= limits[:, None])
    scores = tl.where(seen, scores, float("-inf"))
    # A row whose window starts past this tile has seen no key yet: its max stays -inf, and exp(-inf - 0) = 0
    # keeps it empty (exp(-inf - -inf) would be NaN).
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    v = tl.load(v_cache + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)


@triton.jit
def _decode_kernel(q_ptr, k_cache, v_cache, block_tables, seq_lens, out_ptr, lse_ptr, scale, window,
                   stride_qb, stride_qh, stride_ch, stride_cb, stride_cs, stride_tb, stride_ob, stride_oh, stride_os,
                   stride_lb, stride_lh, block_size, partition_size, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   PRECISION: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    first = tl.maximum(seq_len - window, 0)  # the first token in the query's window: partitions count from it
    start = first + split * partition_size
    end = tl.minimum(seq_len, start + partition_size)
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, DIM_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    cache_base = kv_head.to(tl.int64) * stride_ch
    lowers = tl.zeros([GROUP_PAD], tl.int32) + start  # every query sees every key of the partition
    limits = tl.zeros([GROUP_PAD], tl.int32) + end
    for tile in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, block_tables + seq * stride_tb, cache_base,
                                     tile + tl.arange(0, BLOCK_N), end, lowers, limits, dims, dim_mask, block_size,
                                     stride_cb, stride_cs, scale, PRECISION)
    out_rows = seq * stride_ob + heads * stride_oh + split * stride_os
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # A partition past the sequence's end saw no token: weight zero in the merge (log-sum-exp of -inf).
        empty = l_i == 0.0
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        partial = acc / tl.where(empty, 1.0, l_i)[:, None]
        tl.store(out_ptr + out_rows[:, None] + dims[None, :], partial, mask=out_mask)
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=row_mask)
    else:
        tl.store(out_ptr + out_rows[:, None] + dims[None, :], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _merge_kernel(partial_ptr, lse_ptr, out_ptr, num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  stride_ob, stride_oh, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_mask = splits < num_splits
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_mask, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))  # split 0 always holds tokens, so the max is finite
    partial = tl.load(partial_ptr + seq * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
                      mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Partitions per sequence: enough programs for about two per SM, none shorter than MIN_PARTITION tokens."""
    wanted = triton.cdiv(2 * _num_sms(device), batch * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_seq_len, MIN_PARTITION)))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int | None = None, splits: int | None = None) -> torch.Tensor:
    """query [B, H, D]; caches [Hkv, num_blocks, block_size, D] with contiguous head rows; block_tables
    [B, max_blocks]; seq_lens [B] (including the query token); each query sees the last `window` tokens of its
    sequence (None: all). Returns [B, H, D] in the query's dtype. `splits` overrides the number of partitions per
    sequence (tests)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    query = query.contiguous()
    block_tables = block_tables.contiguous()
    # The block table's width (or the window) bounds every span without reading seq_lens back from the device.
    span = min(block_tables.shape[1] * block_size, window or NO_WINDOW)
    splits = splits or num_splits(batch, num_kv_heads, span, query.device)
    partition = triton.cdiv(triton.cdiv(span, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(span, partition)
    out = torch.empty_like(query)
    meta = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=BLOCK_N,
                # Products run in float32 on tensor cores as TF32, which holds bf16/fp16 inputs exactly; a float32
                # cache keeps full float32 products.
                PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    cache_strides = key_cache.stride()[:3]
    if splits == 1:
        _decode_kernel[(batch, num_kv_heads, 1)](
            query, key_cache, value_cache, block_tables, seq_lens, out, out, scale, window or NO_WINDOW,
            query.stride(0), query.stride(1), *cache_strides, block_tables.stride(0), out.stride(0), out.stride(1),
            0, 0, 0, block_size, partition, SPLIT=False, **meta)
        return out
    partial = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=query.device)
    _decode_kernel[(batch, num_kv_heads, splits)](
        query, key_cache, value_cache, block_tables, seq_lens, partial, lse, scale, window or NO_WINDOW,
        query.stride(0), query.stride(1), *cache_strides, block_tables.stride(0), *partial.stride()[:3],
        *lse.stride()[:2], block_size, partition, SPLIT=True, **meta)
    _merge_kernel[(batch, num_heads)](
        partial, lse, out, splits, *partial.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=meta["DIM_PAD"], SPLITS_PAD=triton.next_power_of_2(splits))
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, block_tables, tile_chunks, tile_starts, query_starts, query_lens,
                    context_lens, out_ptr, scale, window, stride_qt, stride_qh, stride_ch, stride_cb, stride_cs,
                    stride_tb, stride_ot, stride_oh, block_size, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    chunk = tl.load(tile_chunks + tile)
    first_row = tl.load(tile_starts + tile)
    query_start = tl.load(query_starts + chunk)
    query_len = tl.load(query_lens + chunk)
    context_len = tl.load(context_lens + chunk)
    rows = first_row + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_PAD)
    row_mask = rows < query_len
    dim_mask = dims < HEAD_DIM
    q_offsets = (query_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
    positions = context_len + rows  # query i of the chunk sits at position context_len + i and sees keys up to that
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    cache_base = (head // GROUP).to(tl.int64) * stride_ch
    end = tl.minimum(context_len + query_len, context_len + first_row + BLOCK_M)  # past the tile's last query
    lowers = positions - window + 1  # and from the first key in its window
    for start in range(tl.maximum(context_len + first_row - window + 1, 0), end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, block_tables + chunk * stride_tb,
                                     cache_base, start + tl.arange(0, BLOCK_N), end, lowers, positions, dims,
                                     dim_mask, block_size, stride_cb, stride_cs, scale, PRECISION)
    out_offsets = (query_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    l_i = tl.where(row_mask, l_i, 1.0)  # rows past the chunk's end (not stored) may have no key in their window
    tl.store(out_ptr + out_offsets, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                            context_lens: torch.Tensor, tile_chunks: torch.Tensor, tile_starts: torch.Tensor,
                            scale: float, block_m: int, window: int | None = None) -> torch.Tensor:
    """Every prefill chunk of a step in one launch, reading K/V (the chunk's own included, already written) through
    the block tables. query [T, H, D]: the chunks' queries back to back, chunk c's at rows query_starts[c] ..
    + query_lens[c], its first at position context_lens[c] of its sequence; block_tables [C, max_blocks]; one
    program per (tile of `block_m` queries of one chunk: tile_chunks, tile_starts) and query head. Each query sees
    the keys of the last `window` positions up to its own (None: all up to its own). Returns [T, H, D] in the
    query's dtype."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    query = query.contiguous()
    out = torch.empty_like(query)
    _prefill_kernel[(tile_chunks.shape[0], num_heads)](
        query, key_cache, value_cache, block_tables, tile_chunks, tile_starts, query_starts, query_lens, context_lens,
        out, scale, window or NO_WINDOW, query.stride(0), query.stride(1), *key_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), block_size, GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    return out
