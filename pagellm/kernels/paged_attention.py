"""Paged decode attention on the CPU: the C kernel (built on first use by `kernels.build`) and its caller.

Calls go through ctypes, which releases the GIL, so a small thread pool splits the batch across cores. When the
kernel cannot be built, `load()` returns None and the attention layer uses its PyTorch path.
"""
from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from pagellm.kernels.build import load_library

_SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11"]
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@cache
def load() -> ctypes.CDLL | None:
    library = load_library(_SOURCE, _FLAGS, "CPU decode attention")
    if library is not None:
        function = library.paged_decode_attention_f32
        function.argtypes = [_PTR] * 6 + [_I64] * 8 + [_F32]
        function.restype = ctypes.c_int
        library.reshape_and_cache_f32.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]
        library.reshape_and_cache_f32.restype = None
    return library


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] float32 with contiguous head rows (any token stride); caches [Hkv, num_blocks,
    block_size, D]; slot_mapping [T] int64."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.stride()[1:] == (head_dim, 1) and value.stride()[1:] == (head_dim, 1)
    load().reshape_and_cache_f32(key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0),
                                 slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_dim,
                                 key_cache.shape[1] * key_cache.shape[2], key_cache.data_ptr(),
                                 value_cache.data_ptr())


@cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagellm-cpu-kernel")


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, H, D] float32; caches [Hkv, num_blocks, block_size, D]; block_tables [B, max_blocks] int64;
    seq_lens [B] int64 (including the query token). Returns [B, H, D]."""
    library = load()
    assert library is not None, "call load() first and fall back when it returns None"
    query = query.contiguous()
    block_tables = block_tables.contiguous()
    batch, num_heads, head_dim = query.shape
    num_kv_heads, num_blocks, block_size, _ = key_cache.shape
    out = torch.empty_like(query)
    args = [query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
            seq_lens.data_ptr(), out.data_ptr()]
    shape = [num_heads, num_kv_heads, head_dim, num_blocks, block_size, block_tables.shape[1]]

    def run(start: int, end: int) -> None:
        if library.paged_decode_attention_f32(*args, start, end, *shape, scale) != 0:
            raise MemoryError("paged_decode_attention_f32 could not allocate its score buffer")

    workers = min(torch.get_num_threads(), batch)
    if workers <= 1:
        run(0, batch)
        return out
    # Balance by total context, not by count: one long sequence costs as much as many short ones.
    lengths = seq_lens.tolist()
    total, bounds, acc = sum(lengths), [0], 0
    for i, length in enumerate(lengths):
        acc += length
        if acc * workers >= total * len(bounds) and len(bounds) < workers:
            bounds.append(i + 1)
    bounds.append(batch)
    futures = [_pool(workers).submit(run, s, e) for s, e in zip(bounds, bounds[1:]) if e > s]
    for future in futures:
        future.result()
    return out
