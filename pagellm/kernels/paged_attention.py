"""The binding of `paged_attention_cpu.c`: paged decode attention on the CPU and the cache write that feeds it.

Owns the C library's ctypes signatures (`SIGNATURES`), its build flags, the numbering of cache element types
(`KV_TYPES`) and the Python callers. The kernel spreads (sequence, kv head, partition) units over OpenMP threads
itself. Queries and outputs are float32; the cache may be float32, float16, bfloat16 or an 8-bit float
(`KV_TYPES`). When the kernel cannot be built, `load()` returns None and the attention layer uses its PyTorch
path.
"""
from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from pagellm.kernels.build import Signature, isa_flags, load_library

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
# The C side's KV_F32, KV_F16, KV_BF16, KV_E4M3, KV_E5M2 (kv_types.h).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}

# Every exported function of paged_attention_cpu.c, under the prototype it mirrors (tests/kernels/test_bindings.py
# checks both ways). decoder_cpu.c calls the same two through its attention_fn and cache_fn pointer types.
SIGNATURES: dict[str, Signature] = {
    # int paged_decode_attention(const float *query, const void *key_cache, const void *value_cache,
    #                            const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t batch,
    #                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
    #                            int64_t block_size, int64_t max_blocks, float scale, int kv_type,
    #                            int64_t sliding_window, int64_t requested_partition_tokens, int nthreads);
    "paged_decode_attention": (_INT, [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                                      _F32, _INT, _I64, _I64, _INT]),
    # void reshape_and_cache(const float *k, const float *v, int64_t k_stride, int64_t v_stride, const int64_t *slots,
    #                        int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
    #                        void *key_cache, void *value_cache, int kv_type);
    "reshape_and_cache": (None, [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT]),
}


@cache
def load() -> ctypes.CDLL | None:
    # PAGELLM_CPU_ISA=scalar: the portable loops and conversions, as on a CPU without AVX2 or F16C (isa_flags).
    return load_library(SOURCE, _FLAGS + isa_flags(), "CPU decode attention", SIGNATURES)


def loaded() -> ctypes.CDLL:
    """The library, for callers that know it loads (they checked `load()` first)."""
    library = load()
    assert library is not None, "check load() first and use the PyTorch path when it returns None"
    return library


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] float32 with contiguous head rows (any token stride); caches [Hkv, num_blocks,
    block_size, D] of a `KV_TYPES` dtype (values rounded to it, to nearest even, 8-bit floats saturating at their
    largest finite value); slot_mapping [T] int64."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.dtype == value.dtype == torch.float32
    assert key.stride()[1:] == (head_dim, 1) and value.stride()[1:] == (head_dim, 1)
    loaded().reshape_and_cache(key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0),
                               slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_dim,
                               key_cache.shape[1] * key_cache.shape[2], key_cache.data_ptr(), value_cache.data_ptr(),
                               KV_TYPES[key_cache.dtype])


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, partition_tokens: int = 0) -> torch.Tensor:
    """query [B, H, D] float32; caches [Hkv, num_blocks, block_size, D] of a `KV_TYPES` dtype; block_tables
    [B, max_blocks] int64; seq_lens [B] int64 (including the query token). Returns [B, H, D] float32.
    `sliding_window`: each query sees only the last that many tokens of its sequence (None: all of them).
    `partition_tokens` splits sequences into partitions of that many tokens (rounded up to whole blocks); 0 lets
    the kernel split only when there are too few (sequence, kv head) pairs for the threads."""
    library = loaded()
    query = query.contiguous()
    block_tables = block_tables.contiguous()
    batch, num_heads, head_dim = query.shape
    num_kv_heads, num_blocks, block_size, _ = key_cache.shape
    out = torch.empty_like(query)
    status = library.paged_decode_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
        block_tables.shape[1], scale, KV_TYPES[key_cache.dtype], sliding_window or 0, partition_tokens,
        torch.get_num_threads())
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch buffers")
    return out
