"""Paged decode attention on the CPU: the C kernel (built on first use by `kernels.build`) and its caller.

The kernel spreads (sequence, kv head) pairs over OpenMP threads itself. When it cannot be built, `load()` returns
None and the attention layer uses its PyTorch path.
"""
from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from pagellm.kernels.build import load_library

_SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@cache
def load() -> ctypes.CDLL | None:
    library = load_library(_SOURCE, _FLAGS, "CPU decode attention")
    if library is not None:
        function = library.paged_decode_attention_f32
        function.argtypes = [_PTR] * 6 + [_I64] * 7 + [_F32, ctypes.c_int]
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
    status = library.paged_decode_attention_f32(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
        block_tables.shape[1], scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("paged_decode_attention_f32 could not allocate its score buffer")
    return out
