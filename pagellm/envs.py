"""Settings read from the environment, in one place."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where pagellm keeps converted GGUF checkpoints and built kernels: $PAGELLM_CACHE_DIR or ~/.cache/pagellm."""
    return Path(os.environ.get("PAGELLM_CACHE_DIR") or "~/.cache/pagellm").expanduser()


def c_kernels_disabled() -> bool:
    """PAGELLM_DISABLE_C_KERNELS=1 forces the PyTorch attention path on CPU."""
    return os.environ.get("PAGELLM_DISABLE_C_KERNELS") == "1"


def attention_backend() -> str | None:
    """PAGELLM_ATTENTION_BACKEND=triton|torch overrides the decode attention chosen for the device (the C kernel on
    CPU, Triton on CUDA). `triton` on the CPU runs Triton's interpreter: a way to test the CUDA kernel anywhere."""
    value = os.environ.get("PAGELLM_ATTENTION_BACKEND") or None
    if value not in (None, "triton", "torch"):
        raise ValueError(f"PAGELLM_ATTENTION_BACKEND must be 'triton' or 'torch' (or unset), got {value!r}.")
    return value


def api_key() -> str | None:
    """PAGELLM_API_KEY: the key `pagellm serve` requires (as `Authorization: Bearer ...`) without --api-key."""
    return os.environ.get("PAGELLM_API_KEY") or None


def cpu_isa() -> str | None:
    """PAGELLM_CPU_ISA=scalar builds every C kernel for the compiler's baseline (no AVX2, FMA or F16C) and makes the
    packed-weight kernels skip their AVX2 paths: the portable code a CPU without them runs (tests run both).
    PAGELLM_CPU_ISA=avx2 keeps the packed-weight tiles off their AVX-512 variant (which computes the same floats)."""
    return os.environ.get("PAGELLM_CPU_ISA") or None


WORKER_MULTIPROC_METHODS = ("fork", "spawn", "forkserver")


def worker_multiproc_method() -> str | None:
    """PAGELLM_WORKER_MULTIPROC_METHOD=fork|spawn|forkserver: how worker ranks start (vLLM's
    VLLM_WORKER_MULTIPROC_METHOD); unset, pagellm forks where that is safe (see process_utils.py)."""
    value = os.environ.get("PAGELLM_WORKER_MULTIPROC_METHOD") or None
    if value not in (None, *WORKER_MULTIPROC_METHODS):
        raise ValueError(f"PAGELLM_WORKER_MULTIPROC_METHOD must be one of {', '.join(WORKER_MULTIPROC_METHODS)} "
                         f"(or unset), got {value!r}.")
    return value
