"""The binding of `elementwise_cpu.c`: RMSNorm, SiLU- and tanh-GELU-and-multiply and RoPE for float32 tensors on the
CPU.

Owns the C library's ctypes signatures (`SIGNATURES`), its build flags and the Python callers. One C call each
instead of several PyTorch operators; the layers use them where `applies(x)` and keep their PyTorch path otherwise
(CUDA, other dtypes, no compiler). The fused decoder (`kernels.decoder`) calls the same C functions by address."""
from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from pagellm.kernels.build import Signature, isa_flags, load_library

SOURCE = Path(__file__).with_name("elementwise_cpu.c")
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
_I64, _INT, _F32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p

# Every exported function of elementwise_cpu.c, under the prototype it mirrors (tests/kernels/test_bindings.py
# checks both ways).
SIGNATURES: dict[str, Signature] = {
    # void rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
    #                   float eps, int nthreads);
    "rms_norm_f32": (None, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT]),
    # void silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int nthreads);
    "silu_and_mul_f32": (None, [_PTR, _PTR, _I64, _I64, _INT]),
    # void gelu_tanh_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int nthreads);
    "gelu_tanh_and_mul_f32": (None, [_PTR, _PTR, _I64, _I64, _INT]),
    # void rope_f32(float *x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t dim,
    #               const int64_t *positions, const float *cos_table, const float *sin_table);
    "rope_f32": (None, [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR]),
}


@cache
def load() -> ctypes.CDLL | None:
    return load_library(SOURCE, _FLAGS + isa_flags(), "RMSNorm, SiLU, GELU and RoPE", SIGNATURES)


def loaded() -> ctypes.CDLL:
    """The library, for callers that know it loads (they checked `load()` or `applies` first)."""
    library = load()
    assert library is not None, "check load() first and use the PyTorch path when it returns None"
    return library


def applies(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def _check_float32(*tensors: torch.Tensor) -> None:
    """The C side reads raw float32 memory: anything else would be read (and written) out of bounds."""
    for tensor in tensors:
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise TypeError(f"CPU float32 tensors expected, got {tensor.dtype} on {tensor.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension; with `residual`, first `residual += x` (in place) and normalise
    the sum. x (and residual) contiguous [..., dim]."""
    dim = weight.shape[0]
    _check_float32(x, weight, *(() if residual is None else (residual,)))
    out = torch.empty(x.shape, dtype=torch.float32)
    loaded().rms_norm_f32(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                          out.data_ptr(), x.numel() // dim, dim, eps, torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for contiguous x [..., 2d]."""
    return _gated(loaded().silu_and_mul_f32, x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(x[..., :d], approximate="tanh") * x[..., d:] for contiguous x [..., 2d]."""
    return _gated(loaded().gelu_tanh_and_mul_f32, x)


def _gated(function, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    _check_float32(x)
    out = torch.empty((*x.shape[:-1], d), dtype=torch.float32)
    function(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d, torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> None:
    """Rotate x [T, heads, dim] in place (head rows contiguous, any token stride) by full-width tables."""
    tokens, heads, dim = x.shape
    _check_float32(x, cos_table, sin_table)
    if x.stride()[1:] != (dim, 1) or positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError("rope_ needs contiguous head rows and contiguous int64 positions")
    loaded().rope_f32(x.data_ptr(), tokens, heads, x.stride(0), dim, positions.data_ptr(), cos_table.data_ptr(),
                      sin_table.data_ptr())
