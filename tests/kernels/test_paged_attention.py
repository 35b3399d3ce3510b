"""Every decode-attention backend (the C kernel, the Triton kernel, the PyTorch path) and the prefill paths against
a plain reference: softmax attention over each sequence's keys, written out per sequence with no paging at all
(over a narrower cache type, the keys and values rounded to it by torch).

Without a GPU the Triton kernel runs under Triton's interpreter, which must be switched on before the kernel
module is first imported (this module's import, at collection)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagellm.kernels import paged_attention as cpu_kernels  # noqa: E402
from pagellm.kernels import triton_attention  # noqa: E402
from pagellm.model_executor.host_copy import StagedCopy  # noqa: E402
from pagellm.model_executor.layers import attention as attention_layer  # noqa: E402
from pagellm.model_executor.layers.attention import (  # noqa: E402
    BACKENDS,
    PREFILL_BLOCK_M,
    Attention,
    AttentionMetadata,
    PrefillBatch,
    PrefillChunk,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]  # --kv-cache-dtype's


def reference_attention(q, keys, values, scale, causal_offset=None):
    """q [Lq, H, D]; keys/values [Lk, Hkv, D]; query i sees keys 0..causal_offset + i (all when None)."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    values = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) * scale
    if causal_offset is not None:
        allowed = torch.arange(keys.shape[0])[None, :] <= (causal_offset + torch.arange(q.shape[0]))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double()).float()


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: rounded by torch, 8-bit floats clamped to their largest finite value first
    (they saturate, as vLLM's cache writes do)."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return x.to(dtype)


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it, widened back to float32."""
    return stored(x, dtype).float()


def random_paged_cache(seq_lens, kv_heads, head_dim, block_size, seed=0):
    """A cache whose blocks are shuffled, plus each sequence's block table and its contiguous K/V."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen)
    tables, contiguous = [], []
    for n, nb in zip(seq_lens, blocks_per_seq):
        table = [order.pop() for _ in range(nb)]
        tables.append(table)
        kv = cache[:, :, table].flatten(2, 3)[:, :, :n]  # [2, Hkv, n, D]
        contiguous.append(kv.permute(0, 2, 1, 3))  # [2, n, Hkv, D]
    return cache, tables, contiguous


@pytest.fixture(params=["c", "triton", "torch"])
def decode_backend(request):
    if request.param == "c":
        assert cpu_kernels.load() is not None, "the C kernel must build on the test machine (gcc is required)"
    return request.param


def decode_metadata(tables: list[list[int]], seq_lens: list[int], pad_block: int = 0) -> AttentionMetadata:
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [pad_block] * (max_blocks - len(t)) for t in tables])
    return AttentionMetadata(torch.empty(0, dtype=torch.long), len(seq_lens), block_tables, torch.tensor(seq_lens), [])


def run_decode(attn: Attention, q, cache, meta: AttentionMetadata, backend: str) -> torch.Tensor:
    """attn's decode on `backend`, the Triton one on this machine's device (the GPU, or the CPU interpreter)."""
    if backend == "triton":
        q, cache = q.to(DEVICE), cache.to(DEVICE)
        meta = AttentionMetadata(meta.slot_mapping, meta.num_decodes, meta.decode_block_tables.to(DEVICE),
                                 meta.decode_seq_lens.to(DEVICE), [])
    return BACKENDS[backend]().decode(q, cache[0], cache[1], meta, attn.scale).cpu()


def triton_decode(q, cache, meta: AttentionMetadata, scale: float, splits: int) -> torch.Tensor:
    """The Triton kernel called directly with `splits` partitions per sequence, on this machine's device."""
    return triton_attention.paged_decode_attention(
        q.to(DEVICE), cache[0].to(DEVICE), cache[1].to(DEVICE), meta.decode_block_tables.to(DEVICE),
        meta.decode_seq_lens.to(DEVICE), scale, splits=splits).cpu()


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 32, 16), (9, 3, 64, 4), (2, 2, 16, 1)])
def test_decode_matches_reference(decode_backend, heads, kv_heads, head_dim, block_size):
    seq_lens = [1, 5, 17, 64, 33, 2]
    cache, tables, contiguous = random_paged_cache(seq_lens, kv_heads, head_dim, block_size)
    q = torch.randn(len(seq_lens), heads, head_dim)
    attn = Attention(heads, kv_heads, head_dim)
    out = run_decode(attn, q, cache, decode_metadata(tables, seq_lens), decode_backend)
    for i, (k, v) in enumerate(contiguous):
        expected = reference_attention(q[i:i + 1], k, v, attn.scale)
        torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-5, atol=1e-5)


def test_decode_ignores_garbage_in_padding(decode_backend):
    """Slots past a sequence's length (padding) may hold anything, even NaN, without affecting the result."""
    seq_lens = [3, 20]
    cache, tables, contiguous = random_paged_cache(seq_lens, 2, 16, 8)
    for n, table in zip(seq_lens, tables):
        cache[:, :, table[-1], n % 8 or 8:] = 1e4 if decode_backend == "torch" else float("nan")
    q = torch.randn(2, 4, 16)
    attn = Attention(4, 2, 16)
    out = run_decode(attn, q, cache, decode_metadata(tables, seq_lens, pad_block=tables[0][0]), decode_backend)
    for i, (k, v) in enumerate(contiguous):
        torch.testing.assert_close(out[i:i + 1], reference_attention(q[i:i + 1], k, v, attn.scale),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(16, 2, 128, 16), (6, 6, 80, 8)])
def test_triton_decode_split_sequences(splits, heads, kv_heads, head_dim, block_size):
    """Sequences cut into partitions (flash-decoding), some of which hold no token of a short sequence, merge to
    the same attention; also GQA groups of 8, head sizes that are not powers of two."""
    seq_lens = [1, 300, 1000, 65]
    cache, tables, contiguous = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, seed=splits)
    q = torch.randn(len(seq_lens), heads, head_dim)
    out = triton_decode(q, cache, decode_metadata(tables, seq_lens), head_dim ** -0.5, splits)
    for i, (k, v) in enumerate(contiguous):
        torch.testing.assert_close(out[i:i + 1], reference_attention(q[i:i + 1], k, v, head_dim ** -0.5),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_decode_half_precision(dtype):
    """bf16/fp16 caches (CUDA's defaults): float32 arithmetic on the stored values, the result rounded once."""
    seq_lens = [7, 130, 41]
    cache, tables, contiguous = random_paged_cache(seq_lens, 2, 64, 16)
    cache = cache.to(dtype)
    q = torch.randn(len(seq_lens), 8, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    meta = decode_metadata(tables, seq_lens)
    for splits in (1, 2):
        out = triton_decode(q, cache, meta, 0.125, splits)
        assert out.dtype == dtype
        for i, (k, v) in enumerate(contiguous):
            expected = reference_attention(q[i:i + 1].float(), k.to(dtype).float(), v.to(dtype).float(), 0.125)
            # Within two ulps of the output's own type at each value's magnitude: the result is rounded once, and
            # float32 sums in another order may land it on the neighbouring value. (A fixed bound failed once on
            # a value just over 2, where bfloat16's ulp doubles.)
            ulp = torch.finfo(dtype).eps * expected.abs().clamp(min=1.0)
            error = (out[i:i + 1].float() - expected).abs()
            assert (error <= 2 * ulp).all(), (error / ulp).max()


@pytest.fixture(params=["native", "scalar"])
def attention_isa(request, monkeypatch):
    """The C attention kernel built for this CPU (AVX2, F16C), or its portable loops (PAGELLM_CPU_ISA=scalar: what a
    CPU without them runs)."""
    if request.param == "scalar":
        monkeypatch.setenv("PAGELLM_CPU_ISA", "scalar")
    cpu_kernels.load.cache_clear()
    assert cpu_kernels.load() is not None
    yield request.param
    cpu_kernels.load.cache_clear()  # the next caller builds (or finds) the native one again


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seq_lens,partition_tokens", [
    (9, 3, 64, 16, [2000], 0),  # one conversation, 3 kv heads: split so that every thread gets work
    (4, 2, 32, 4, [1500, 5, 300], 256),  # a short sequence's later partitions are empty; scalar value sums
    (2, 2, 16, 1, [1, 17, 600], 7),  # scalar dot products too; partitions of 7 tokens of 1-token blocks
    (4, 2, 64, 16, [40, 3], 0),  # no split
    (8, 2, 32, 8, [300, 40], 64),  # groups of 4: value sums in a tile of three heads and a tile of one
])
def test_c_decode_over_narrow_caches_and_partitions(kv_dtype, heads, kv_heads, head_dim, block_size, seq_lens,
                                                    partition_tokens, attention_isa):
    """The C kernel reads caches of every type (float32 arithmetic on the stored values) and splits
    long sequences into partitions whose partial softmaxes it merges (flash-decoding)."""
    cache, tables, contiguous = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, seed=head_dim)
    q = torch.randn(len(seq_lens), heads, head_dim)
    meta = decode_metadata(tables, seq_lens)
    out = cpu_kernels.paged_decode_attention(q, cache[0].to(kv_dtype), cache[1].to(kv_dtype),
                                             meta.decode_block_tables, meta.decode_seq_lens, head_dim ** -0.5,
                                             partition_tokens=partition_tokens)
    for i, (k, v) in enumerate(contiguous):
        expected = reference_attention(q[i:i + 1], rounded(k, kv_dtype), rounded(v, kv_dtype), head_dim ** -0.5)
        torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-5, atol=1e-5)


def verify_batch(block_size, kv_heads, head_dim):
    """A decode batch as a speculative verify step sends it: each sequence's 1 + k rows are consecutive entries with
    its one block table and lengths one apart, among single rows, a run longer than the kernel's cap (16), and
    sequences sharing leading blocks (prefix caching). Returns the cache and the entries' (table, length)."""
    # 0: runs of 5 (and 2) rows; 1: a single row; 2: a run across a block (and a 64-token partition) edge; 3: 18 rows.
    # 4 (A), 5 and 6: tails of B and C, which share A's first 32 tokens' blocks.
    cache, tables, _ = random_paged_cache([300, 17, 66, 127, 40, 9, 1], kv_heads, head_dim, block_size, seed=7)
    shared = tables[4][:32 // block_size]
    a, b, c = tables[4], shared + tables[5], shared + tables[6]
    entries = [(tables[0], n) for n in range(296, 301)] + [(tables[1], 17)]
    entries += [(tables[2], n) for n in range(61, 67)] + [(tables[0], 299), (tables[0], 300)]
    entries += [(tables[3], n) for n in range(110, 128)]
    # A at 40 then B at 41 (the same first blocks, then their own): not one sequence. A at 32 then C at 33: C's
    # first 32 tokens are A's, so reading A's tokens through C's table is exact.
    entries += [(a, 40), (b, 41), (a, 32), (c, 33), (tables[1], 16)]
    return cache, entries


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window,partition_tokens", [
    (9, 3, 64, 16, None, 0),  # the default model's shape
    (4, 2, 32, 4, None, 64),  # forced partitions: a run's rows split across a partition edge
    (8, 2, 32, 8, 50, 0),  # sliding window: each row its own window start, inside a block
    (2, 2, 16, 1, 37, 7),  # window and partitions of 7 one-token blocks; scalar dot products and value sums
    (6, 2, 64, 16, 100, 32),
])
def test_c_decode_of_speculative_verify_rows(kv_dtype, heads, kv_heads, head_dim, block_size, window,
                                             partition_tokens, attention_isa):
    """The kernel reads a sequence's keys and values once for its run of verify rows; each row must still see only
    its own tokens (its causal end, its window) and sequences that merely share blocks must not be confused: every
    entry against the reference over its own tokens, and against itself decoded alone in its own call."""
    cache, entries = verify_batch(block_size, kv_heads, head_dim)
    tables, lens = [t for t, _ in entries], [n for _, n in entries]
    q = torch.randn(len(entries), heads, head_dim, generator=torch.Generator().manual_seed(heads))
    key_cache, value_cache = stored(cache[0], kv_dtype), stored(cache[1], kv_dtype)
    scale = head_dim ** -0.5

    def decode(rows):
        meta = decode_metadata([tables[i] for i in rows], [lens[i] for i in rows])
        return cpu_kernels.paged_decode_attention(q[rows], key_cache, value_cache, meta.decode_block_tables,
                                                  meta.decode_seq_lens, scale, sliding_window=window,
                                                  partition_tokens=partition_tokens)

    out = decode(list(range(len(entries))))
    for i, (table, n) in enumerate(entries):
        kv = cache[:, :, table].flatten(2, 3)[:, :, n - min(n, window or n):n].permute(0, 2, 1, 3)
        expected = reference_attention(q[i:i + 1], rounded(kv[0], kv_dtype), rounded(kv[1], kv_dtype), scale)
        torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"{i}: {m}")
        alone = decode([i])
        torch.testing.assert_close(out[i:i + 1], alone, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"{i} alone: {m}")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES[1:])
def test_torch_decode_over_narrow_caches(kv_dtype):
    seq_lens = [9, 70, 1]
    cache, tables, contiguous = random_paged_cache(seq_lens, 2, 32, 8)
    q = torch.randn(len(seq_lens), 4, 32)
    attn = Attention(4, 2, 32)
    out = run_decode(attn, q, cache.to(kv_dtype), decode_metadata(tables, seq_lens), "torch")
    for i, (k, v) in enumerate(contiguous):
        expected = reference_attention(q[i:i + 1], rounded(k, kv_dtype), rounded(v, kv_dtype), attn.scale)
        torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("writer", ["c", "torch"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cache_write_rounds_as_torch_does(kv_dtype, writer, attention_isa):
    """New keys and values land in their slots (C kernel or PyTorch path) rounded to nearest even, bit for bit as
    torch's .to() rounds them, from 1e-9 (float16 subnormals, and below) to 1e6 (past float16's range: infinity;
    8-bit floats saturate at their largest finite value), read through views of a fused QKV row as the model passes
    them."""
    tokens, kv_heads, head_dim, num_blocks, block_size = 37, 3, 64, 8, 16
    gen = torch.Generator().manual_seed(3)
    magnitudes = 10.0 ** (torch.rand(tokens, 6 * kv_heads * head_dim, generator=gen) * 15 - 9)
    qkv = torch.randn(tokens, 6 * kv_heads * head_dim, generator=gen) * magnitudes
    k = qkv[:, 4 * kv_heads * head_dim:5 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 5 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    key_cache = torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=kv_dtype)
    value_cache = torch.zeros_like(key_cache)
    write = cpu_kernels.reshape_and_cache if writer == "c" else attention_layer.reshape_and_cache
    write(k, v, key_cache, value_cache, slots)
    for cache, fresh in ((key_cache, k), (value_cache, v)):
        expected = torch.zeros_like(cache).view(kv_heads, -1, head_dim)
        expected.view(torch.uint8)[:, slots] = stored(fresh.transpose(0, 1), kv_dtype).view(torch.uint8)
        assert torch.equal(cache.view(kv_heads, -1, head_dim).view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("head_dim", [64, 16])  # the vector loads, and the scalar loop (head_dim not a multiple of 32)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_c_decode_reads_every_8bit_float_as_torch_does(kv_dtype, head_dim, attention_isa):
    """Each of the 256 codes (sub-normals, zeros, the largest values, e5m2's infinities) widens to torch's float32
    value: a one-token sequence's output is its value row. e4m3fn's NaN code is left out (the kernel reads it as
    480: a NaN key or value has no meaning to recover)."""
    codes = torch.arange(256, dtype=torch.uint8)
    if kv_dtype == torch.float8_e4m3fn:
        codes = codes[(codes & 0x7f) != 0x7f]
    else:
        codes = codes[~torch.isnan(codes.view(kv_dtype).float())]
    rows = -(-len(codes) // head_dim)
    values = torch.zeros(rows * head_dim, dtype=torch.uint8)
    values[:len(codes)] = codes
    cache = torch.zeros(2, 1, rows, 1, head_dim, dtype=torch.uint8)  # one kv head, blocks of one token
    cache[1, 0, :, 0] = values.view(rows, head_dim)
    cache = cache.view(kv_dtype)
    meta = decode_metadata([[r] for r in range(rows)], [1] * rows)
    out = cpu_kernels.paged_decode_attention(torch.randn(rows, 1, head_dim), cache[0], cache[1],
                                             meta.decode_block_tables, meta.decode_seq_lens, 1.0)
    expected = values.view(kv_dtype).float().view(rows, 1, head_dim)
    assert torch.equal(out.flatten()[:len(codes)], expected.flatten()[:len(codes)])


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_mixed_batch_with_chunked_prefill_matches_reference(kv_dtype, backend, monkeypatch):
    """Decodes, a fresh prompt and a later chunk of a chunked prefill, in one flat batch through forward(), over a
    cache of each type, with the C kernels (cache write, decode) or PyTorch: what is read back from the cache is
    rounded to its type (a fresh prompt attends to its own float32 K/V)."""
    monkeypatch.setattr(attention_layer.layer, "select_backend", lambda device, dtype: BACKENDS[backend]())
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    attn = Attention(heads, kv_heads, head_dim)
    gen = torch.Generator().manual_seed(1)
    # Full sequences: two decoding (lengths 7 and 12 incl. the new token), a 6-token prompt, and a sequence of
    # 10 tokens whose first 4 are already cached (a second chunk of 6).
    full_lens, cached = [7, 12, 6, 10], [6, 11, 0, 4]
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in full_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in full_lens]
    queries = [torch.randn(n - c, heads, head_dim, generator=gen) for n, c in zip(full_lens, cached)]
    num_blocks = sum(-(-n // block_size) for n in full_lens) + 2
    cache = torch.zeros(2, kv_heads, num_blocks, block_size, head_dim, dtype=kv_dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-n // block_size))] for n in full_lens]

    def slot(seq, pos):
        return tables[seq][pos // block_size] * block_size + pos % block_size

    for s, c in enumerate(cached):  # what earlier steps already wrote
        for p in range(c):
            flat = cache.view(2, kv_heads, -1, head_dim)
            flat[0, :, slot(s, p)], flat[1, :, slot(s, p)] = keys[s][p], values[s][p]
    new = [(s, p) for s in range(4) for p in range(cached[s], full_lens[s])]
    q = torch.cat(queries)
    k = torch.stack([keys[s][p] for s, p in new])
    v = torch.stack([values[s][p] for s, p in new])
    max_blocks = max(len(t) for t in tables[:2])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot(s, p) for s, p in new]),
        num_decodes=2,
        decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:2]]),
        decode_seq_lens=torch.tensor(full_lens[:2]),
        prefills=[PrefillChunk(2, 6, 0, torch.tensor(tables[2])), PrefillChunk(8, 6, 4, torch.tensor(tables[3]))],
    )
    out = attn(q, k, v, cache, meta).view(-1, heads, head_dim)
    start = 0
    for s in range(4):
        n = full_lens[s] - cached[s]
        dtype = torch.float32 if cached[s] == 0 and s >= 2 else kv_dtype  # the fresh prompt reads no cache
        expected = reference_attention(queries[s], rounded(keys[s], dtype), rounded(values[s], dtype), attn.scale,
                                       causal_offset=cached[s])
        torch.testing.assert_close(out[start:start + n], expected, rtol=1e-5, atol=1e-5)
        start += n


def prefill_batch(block_tables, query_lens, context_lens, device) -> PrefillBatch:
    """A PrefillBatch sent as the model runner sends it: its arrays in one staged copy."""
    staged = StagedCopy()
    handles = [staged.add(a) for a in PrefillBatch.host_arrays(block_tables, query_lens, context_lens)]
    tensors = staged.send(device)
    return PrefillBatch(*(tensors[h] for h in handles))


def triton_prefill(q_chunks, cache, tables, context_lens, scale, window=None):
    """The Triton prefill kernel on this machine's device over chunks of queries (chunk i's first query at position
    context_lens[i]), with the metadata of a PrefillBatch, within a sliding `window` if given."""
    query_lens = np.array([len(q) for q in q_chunks])
    max_blocks = max(len(t) for t in tables)
    table = np.array([t + [0] * (max_blocks - len(t)) for t in tables])
    batch = prefill_batch(table, query_lens, np.array(context_lens), DEVICE)
    return triton_attention.paged_prefill_attention(
        torch.cat(q_chunks).to(DEVICE), cache[0].to(DEVICE), cache[1].to(DEVICE), batch.block_tables,
        batch.query_starts, batch.query_lens, batch.context_lens, batch.tile_chunks, batch.tile_starts, scale,
        PREFILL_BLOCK_M, window).cpu()


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 32, 16), (6, 3, 80, 4), (2, 2, 16, 1)])
def test_triton_prefill_matches_reference(heads, kv_heads, head_dim, block_size):
    """Fresh prompts, later chunks of chunked prefills and prompts behind a cached prefix, longer and shorter than a
    tile of queries, in one launch: each query sees its sequence's keys up to its own position."""
    seq_lens, context_lens = [5, 70, 40, 33, 2], [0, 0, 24, 1, 0]
    cache, tables, contiguous = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, seed=head_dim)
    q_chunks = [torch.randn(n - c, heads, head_dim) for n, c in zip(seq_lens, context_lens)]
    out = triton_prefill(q_chunks, cache, tables, context_lens, head_dim ** -0.5)
    start = 0
    for q, (k, v), context in zip(q_chunks, contiguous, context_lens):
        expected = reference_attention(q, k, v, head_dim ** -0.5, causal_offset=context)
        torch.testing.assert_close(out[start:start + len(q)], expected, rtol=1e-5, atol=1e-5)
        start += len(q)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_reads_8bit_float_caches(kv_dtype):
    """--kv-cache-dtype fp8 on CUDA: decode (whole and split) and prefill behind cached context read the 8-bit cache
    in place, widened to float32."""
    seq_lens, context_lens = [7, 130, 41], [0, 64, 40]
    cache, tables, contiguous = random_paged_cache(seq_lens, 2, 64, 16, seed=5)
    cache = stored(cache, kv_dtype)
    q = torch.randn(len(seq_lens), 8, 64)
    for splits in (1, 2):
        out = triton_decode(q, cache, decode_metadata(tables, seq_lens), 0.125, splits)
        for i, (k, v) in enumerate(contiguous):
            expected = reference_attention(q[i:i + 1], rounded(k, kv_dtype), rounded(v, kv_dtype), 0.125)
            torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-5, atol=1e-5)
    q_chunks = [torch.randn(n - c, 8, 64) for n, c in zip(seq_lens, context_lens)]
    out = triton_prefill(q_chunks, cache, tables, context_lens, 0.125)
    start = 0
    for q, (k, v), context in zip(q_chunks, contiguous, context_lens):
        expected = reference_attention(q, rounded(k, kv_dtype), rounded(v, kv_dtype), 0.125, causal_offset=context)
        torch.testing.assert_close(out[start:start + len(q)], expected, rtol=1e-5, atol=1e-5)
        start += len(q)


def test_triton_prefill_half_precision():
    seq_lens, context_lens = [50, 19], [16, 0]
    cache, tables, contiguous = random_paged_cache(seq_lens, 2, 64, 16)
    cache = cache.to(torch.bfloat16)
    q_chunks = [torch.randn(n - c, 8, 64).to(torch.bfloat16) for n, c in zip(seq_lens, context_lens)]
    out = triton_prefill(q_chunks, cache, tables, context_lens, 0.125)
    assert out.dtype == torch.bfloat16
    start = 0
    for q, (k, v), context in zip(q_chunks, contiguous, context_lens):
        expected = reference_attention(q.float(), k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float(), 0.125,
                                       causal_offset=context)
        # within one bf16 ulp of the expected value (TF32 products, then the output's own rounding)
        torch.testing.assert_close(out[start:start + len(q)].float(), expected, rtol=2 ** -7, atol=1e-3)
        start += len(q)


def test_prefill_batch_tiles_cover_every_query_once():
    batch = prefill_batch(np.zeros((3, 2)), np.array([70, 32, 1]), np.array([0, 5, 9]), torch.device("cpu"))
    m = PREFILL_BLOCK_M
    assert batch.query_starts.tolist() == [0, 70, 102] and batch.context_lens.tolist() == [0, 5, 9]
    assert list(zip(batch.tile_chunks.tolist(), batch.tile_starts.tolist())) == [(0, 0), (0, m), (0, 2 * m), (1, 0),
                                                                                (2, 0)]


@pytest.mark.parametrize("device,capability,cache_dtype,refused", [
    ("cuda", (8, 0), torch.float8_e4m3fn, True),  # A100: Triton has no e4m3 there
    ("cuda", (8, 6), torch.float8_e4m3fn, True),
    ("cuda", (8, 9), torch.float8_e4m3fn, False),
    ("cuda", (9, 0), torch.float8_e4m3fn, False),
    ("cuda", (8, 0), torch.float8_e5m2, False),
    ("cpu", None, torch.float8_e4m3fn, False),
])
def test_an_e4m3_cache_is_refused_at_start_up_where_triton_cannot_read_it(device, capability, cache_dtype, refused,
                                                                           monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def check():
        attention_layer.check_kv_cache_dtype(cache_dtype, torch.bfloat16, torch.device(device))

    if refused:
        message = (rf"fp8 \(e4m3\) needs a GPU of compute capability 8\.9 or newer .* this one is "
                   rf"{capability[0]}\.{capability[1]}\. Use --kv-cache-dtype fp8_e5m2")
        with pytest.raises(ValueError, match=message):
            check()
    else:
        check()
