"""Keep large host allocations on glibc's heap instead of fresh mmap()s.

By default glibc serves every allocation above its mmap threshold (128 KiB, adapting up to 32 MiB) with a new
mapping and unmaps it on free, so each step's multi-MiB temporaries (KV gathers, matmul outputs) page-fault
their memory in again. On the machines we measured, that made decode attention 3-5x slower. vLLM's CPU backend
asks users to preload tcmalloc for the same reason; raising the thresholds with mallopt() gets the effect
without a preload. The memory stays with the process for reuse, as it would with tcmalloc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from pagellm.logger import init_logger

logger = init_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_settings = {_M_MMAP_THRESHOLD: 1 << 30, _M_TRIM_THRESHOLD: 1 << 34, _M_TOP_PAD: 64 << 20}
_tuned = False


def keep_large_allocations_on_heap() -> bool:
    """Apply the tuning once per process; returns whether glibc accepted it (False elsewhere, e.g. musl, macOS)."""
    global _tuned
    if _tuned:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _tuned = all(mallopt(param, value) == 1 for param, value in _settings.items())
    if not _tuned:
        logger.info("glibc mallopt tuning not applied; large CPU temporaries will be mmap()ed per step")
    return _tuned
