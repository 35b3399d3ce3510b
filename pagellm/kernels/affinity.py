"""The binding of `affinity_cpu.c`: pin the OpenMP pool's threads one per core (`pin_threads`).

Owns the C library's ctypes signatures (`SIGNATURES`) and build flags."""
from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from pagellm.kernels.build import Signature, load_library

SOURCE = Path(__file__).with_name("affinity_cpu.c")
_FLAGS = ["-O2", "-fopenmp", "-fPIC", "-shared", "-std=c11"]

# Every exported function of affinity_cpu.c, under the prototype it mirrors (tests/kernels/test_bindings.py checks
# both ways).
SIGNATURES: dict[str, Signature] = {
    # int pagellm_pin_threads(const int32_t *cores, int n);
    "pagellm_pin_threads": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
}


@cache
def load() -> ctypes.CDLL | None:
    return load_library(SOURCE, _FLAGS, "thread pinning", SIGNATURES)


def pin_threads(cores: list[int]) -> bool:
    """Thread t of the OpenMP pool (len(cores) threads) on cores[t]. False where the library cannot be built or a
    thread could not be pinned (the caller then keeps the process-wide mask only)."""
    library = load()
    if library is None:
        return False
    array = (ctypes.c_int32 * len(cores))(*cores)
    return library.pagellm_pin_threads(ctypes.addressof(array), len(cores)) == 0
