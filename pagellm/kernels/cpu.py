"""Build, load and call pagellm's C kernels for the CPU.

The C source ships with the package and is compiled on first use with the machine's C compiler (gcc or cc) into
the pagellm cache directory, keyed by the source, flags and CPU, so later runs just load it. Calls go through
ctypes, which releases the GIL, so a small thread pool splits the batch across cores. If no compiler is there or
the build fails, `load()` returns None and callers use their PyTorch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from pagellm import envs
from pagellm.logger import init_logger

logger = init_logger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11"]
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), *_FLAGS, compiler, _cpu_signature()]).encode())
    target = envs.cache_root() / "kernels" / f"paged_attention_cpu-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)  # atomic: a concurrent build never exposes a half-written library
    return target


@cache
def load() -> ctypes.CDLL | None:
    if envs.c_kernels_disabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("No C compiler found; CPU decode attention uses the slower PyTorch path.")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Building the CPU attention kernel failed (%s); using the PyTorch path.", detail)
        return None
    function = library.paged_decode_attention_f32
    function.argtypes = [_PTR] * 6 + [_I64] * 8 + [_F32]
    function.restype = ctypes.c_int
    return library


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
