"""Which attention backend runs: the registry of backends and the one choice per (device, dtype).

A new kernel is one backend file plus one line in `BACKENDS`. Without PAGELLM_ATTENTION_BACKEND the first backend
in registry order whose `is_available` holds wins: the C kernels for float32 on the CPU (when they build), Triton on
CUDA (when installed), else PyTorch. The choice is made once per process and shared (`select_backend` caches it).
"""
from __future__ import annotations

from functools import cache

import torch

from pagellm import envs
from pagellm.model_executor.layers.attention.backend import AttentionBackend
from pagellm.model_executor.layers.attention.c_backend import CBackend
from pagellm.model_executor.layers.attention.torch_backend import TorchBackend
from pagellm.model_executor.layers.attention.triton_backend import TritonBackend

# name -> backend, in order of preference (PyTorch last: it runs everywhere).
BACKENDS: dict[str, type[AttentionBackend]] = {
    CBackend.name: CBackend,
    TritonBackend.name: TritonBackend,
    TorchBackend.name: TorchBackend,
}


def select_backend(device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """The backend for computing in `dtype` on `device` (a device or its type, e.g. 'cpu', 'cuda:1')."""
    device_type = device.partition(":")[0] if isinstance(device, str) else device.type
    return _select(device_type, dtype)


@cache
def _select(device_type: str, dtype: torch.dtype) -> AttentionBackend:
    forced = envs.attention_backend()  # 'triton', 'torch' or None (validated there)
    if forced is not None:
        backend = BACKENDS[forced]
    else:
        backend = next(b for b in BACKENDS.values() if b.is_available(device_type, dtype))
    backend.prepare(device_type)
    return backend()


def attention_backend(device_type: str, dtype: torch.dtype) -> str:
    """The name of the backend `select_backend` picks ('c', 'triton' or 'torch')."""
    return select_backend(device_type, dtype).name


def check_kv_cache_dtype(cache_dtype: torch.dtype, model_dtype: torch.dtype, device: torch.device) -> None:
    """Fail at start-up rather than at the first decode when the backend for `device` cannot read a cache of
    `cache_dtype` (Triton and e4m3 before compute capability 8.9)."""
    select_backend(device, model_dtype).check_kv_cache_dtype(cache_dtype, device)
