"""Sliding-window attention in every kernel (the C decode, the Triton decode and prefill, the PyTorch decode and
prefill) against a float64 formula written out per sequence with no paging: a query at position q sees the keys at
positions q - window < k <= q (transformers' sliding_window_overlay), windows smaller and larger than the sequences,
opening inside a block and on a block's edge.

Without a GPU the Triton kernels run under Triton's interpreter (switched on by test_paged_attention's import)."""
from __future__ import annotations

import pytest
import torch
from test_paged_attention import (
    DEVICE,
    KV_DTYPES,
    attention_isa,  # noqa: F401 (a fixture)
    decode_metadata,
    random_paged_cache,
    rounded,
    triton_prefill,
)

from pagellm.kernels import paged_attention as cpu_kernels
from pagellm.kernels import triton_attention
from pagellm.model_executor.layers import attention as attention_layer
from pagellm.model_executor.layers.attention import (
    BACKENDS,
    Attention,
    AttentionMetadata,
    PrefillChunk,
    layer_sliding_window,
)


def windowed_reference(q, keys, values, scale, first_position, window):
    """q [Lq, H, D], query i at position first_position + i; keys/values [Lk, Hkv, D] at positions 0..Lk - 1. Query
    at p sees keys k with p - window < k <= p (window None: k <= p)."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    values = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    query_pos = first_position + torch.arange(q.shape[0])[:, None]
    key_pos = torch.arange(keys.shape[0])[None, :]
    seen = key_pos <= query_pos
    if window is not None:
        seen &= key_pos > query_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).float()


def check_decodes(out, q, contiguous, scale, window, kv_dtype=torch.float32):
    for i, (k, v) in enumerate(contiguous):
        expected = windowed_reference(q[i:i + 1], rounded(k, kv_dtype), rounded(v, kv_dtype), scale, len(k) - 1,
                                      window)
        torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seq_lens,window,partition_tokens", [
    (4, 2, 32, 16, [1, 5, 16, 17, 300, 48], 16, 0),  # windows on a block's edge and inside one; shorter sequences
    (9, 3, 64, 16, [2000, 40], 100, 32),  # partitions counted from the window's block; the first one clipped
    (2, 2, 16, 1, [1, 17, 600], 7, 3),  # scalar dot products, 1-token blocks
    (8, 2, 32, 8, [300, 40], 1000, 64),  # a window longer than every sequence: plain causal attention
    (4, 2, 64, 16, [40, 3], 1, 0),  # a window of one: the query's own value row
    (6, 2, 32, 4, [1500, 2], 37, 0),  # groups of 3, one long conversation split over the threads
])
def test_c_decode_with_a_window(kv_dtype, heads, kv_heads, head_dim, block_size, seq_lens, window, partition_tokens,
                                attention_isa, threads):  # noqa: F811
    cache, tables, contiguous = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, seed=window)
    q = torch.randn(len(seq_lens), heads, head_dim)
    meta = decode_metadata(tables, seq_lens)
    out = cpu_kernels.paged_decode_attention(q, cache[0].to(kv_dtype), cache[1].to(kv_dtype),
                                             meta.decode_block_tables, meta.decode_seq_lens, head_dim ** -0.5,
                                             window, partition_tokens)
    check_decodes(out, q, contiguous, head_dim ** -0.5, window, kv_dtype)


def test_c_decode_reads_no_block_before_the_window():
    """Blocks wholly before a query's window are not read: NaN there changes nothing."""
    seq_lens, window, block_size = [100, 30], 20, 8
    cache, tables, contiguous = random_paged_cache(seq_lens, 2, 32, block_size)
    for n, table in zip(seq_lens, tables):
        for blk in table[:(n - window) // block_size]:
            cache[:, :, blk] = float("nan")
    q = torch.randn(2, 4, 32)
    meta = decode_metadata(tables, seq_lens, pad_block=tables[1][-1])
    out = cpu_kernels.paged_decode_attention(q, cache[0], cache[1], meta.decode_block_tables, meta.decode_seq_lens,
                                             32 ** -0.5, window)
    contiguous = [kv.nan_to_num() for kv in contiguous]  # the reference masks them; NaN * 0 would still be NaN
    check_decodes(out, q, contiguous, 32 ** -0.5, window)


@pytest.mark.parametrize("backend", ["c", "triton", "torch"])
@pytest.mark.parametrize("window", [1, 4, 16, 100])
def test_every_backend_decodes_within_the_window(backend, window):
    seq_lens = [1, 5, 17, 64, 33, 2]
    cache, tables, contiguous = random_paged_cache(seq_lens, 2, 32, 16)
    q = torch.randn(len(seq_lens), 4, 32)
    meta = decode_metadata(tables, seq_lens)
    if backend == "triton":
        q, cache = q.to(DEVICE), cache.to(DEVICE)
        meta = AttentionMetadata(meta.slot_mapping, meta.num_decodes, meta.decode_block_tables.to(DEVICE),
                                 meta.decode_seq_lens.to(DEVICE), [])
    out = BACKENDS[backend]().decode(q, cache[0], cache[1], meta, 32 ** -0.5, window).cpu()
    check_decodes(out, q.cpu(), contiguous, 32 ** -0.5, window)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_triton_decode_splits_the_window(splits):
    """Partitions (flash-decoding) count from each sequence's window, so a long sequence splits only its window."""
    seq_lens, window = [1, 300, 1000, 65], 200
    cache, tables, contiguous = random_paged_cache(seq_lens, 2, 128, 16, seed=splits)
    q = torch.randn(len(seq_lens), 16, 128)
    meta = decode_metadata(tables, seq_lens)
    out = triton_attention.paged_decode_attention(
        q.to(DEVICE), cache[0].to(DEVICE), cache[1].to(DEVICE), meta.decode_block_tables.to(DEVICE),
        meta.decode_seq_lens.to(DEVICE), 128 ** -0.5, window, splits=splits).cpu()
    check_decodes(out, q, contiguous, 128 ** -0.5, window)


@pytest.mark.parametrize("window", [1, 5, 16, 40, 1000])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 32, 16), (2, 2, 16, 1)])
def test_triton_prefill_within_the_window(window, heads, kv_heads, head_dim, block_size):
    """Fresh prompts, later chunks and prompts behind a cached prefix longer than the window, in one launch; windows
    shorter than a tile of queries leave some rows no key in their tile's first keys."""
    seq_lens, context_lens = [5, 70, 90, 33, 2], [0, 0, 50, 1, 0]
    cache, tables, contiguous = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, seed=window)
    q_chunks = [torch.randn(n - c, heads, head_dim) for n, c in zip(seq_lens, context_lens)]
    out = triton_prefill(q_chunks, cache, tables, context_lens, head_dim ** -0.5, window)
    start = 0
    for q, (k, v), context in zip(q_chunks, contiguous, context_lens):
        expected = windowed_reference(q, k, v, head_dim ** -0.5, context, window)
        torch.testing.assert_close(out[start:start + len(q)], expected, rtol=1e-5, atol=1e-5)
        start += len(q)


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [3, 8, 13])
def test_mixed_batch_within_the_window(window, kv_dtype, backend, monkeypatch):
    """Decodes, a fresh prompt and later chunks of chunked prefills (one behind a cached context much longer than the
    window), in one flat batch through forward() with the layer's window, over a cache of each type: what is read
    back from the cache is rounded to its type (a fresh prompt attends to its own float32 K/V)."""
    monkeypatch.setattr(attention_layer.layer, "select_backend", lambda device, dtype: BACKENDS[backend]())
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    attn = Attention(heads, kv_heads, head_dim, sliding_window=window)
    gen = torch.Generator().manual_seed(window)
    full_lens, cached = [40, 12, 30, 50, 9], [39, 11, 0, 20, 2]  # two decodes, then three prefill chunks
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in full_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in full_lens]
    queries = [torch.randn(n - c, heads, head_dim, generator=gen) for n, c in zip(full_lens, cached)]
    num_blocks = sum(-(-n // block_size) for n in full_lens) + 2
    cache = torch.zeros(2, kv_heads, num_blocks, block_size, head_dim, dtype=kv_dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-n // block_size))] for n in full_lens]

    def slot(seq, pos):
        return tables[seq][pos // block_size] * block_size + pos % block_size

    flat = cache.view(2, kv_heads, -1, head_dim)
    for s, c in enumerate(cached):  # what earlier steps already wrote
        for p in range(c):
            flat[0, :, slot(s, p)], flat[1, :, slot(s, p)] = keys[s][p], values[s][p]
    new = [(s, p) for s in range(len(full_lens)) for p in range(cached[s], full_lens[s])]
    starts = [0, 1, 2, 32, 62]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot(s, p) for s, p in new]), num_decodes=2,
        decode_block_tables=torch.tensor([t + [0] * (10 - len(t)) for t in tables[:2]]),
        decode_seq_lens=torch.tensor(full_lens[:2]),
        prefills=[PrefillChunk(starts[s], full_lens[s] - cached[s], cached[s], torch.tensor(tables[s]))
                  for s in range(2, 5)])
    out = attn(torch.cat(queries), torch.stack([keys[s][p] for s, p in new]),
               torch.stack([values[s][p] for s, p in new]), cache, meta).view(-1, heads, head_dim)
    for s, start in enumerate(starts):
        dtype = torch.float32 if s == 2 else kv_dtype  # the fresh prompt reads no cache
        expected = windowed_reference(queries[s], rounded(keys[s], dtype), rounded(values[s], dtype), attn.scale,
                                      cached[s], window)
        torch.testing.assert_close(out[start:start + len(queries[s])], expected, rtol=1e-5, atol=1e-5)


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window must be a positive number of tokens, got 0"):
        Attention(4, 2, 16, sliding_window=0)


@pytest.mark.parametrize("model_type,fields,windows", [
    ("mistral", dict(sliding_window=16), [16, 16, 16, 16]),
    ("mistral", dict(sliding_window=None), [None] * 4),  # Mistral v0.2 on: no window
    ("qwen2", dict(sliding_window=16), [None] * 4),  # use_sliding_window is false by default
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=2), [None, None, 16, 16]),
    ("qwen3", dict(sliding_window=16), [None] * 4),
    ("llama", dict(), [None] * 4),
])
def test_each_layer_gets_the_window_transformers_gives_it(model_type, fields, windows):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, num_hidden_layers=4, **fields)
    assert [layer_sliding_window(config, i) for i in range(4)] == windows
