"""The binding of `linear_cpu.c`: y = x W^T on the CPU with W kept packed in its GGUF storage type. Also
dequantizes whole matrices or selected rows (embeddings).

Owns the C library's ctypes signatures (`SIGNATURES`), the mirror of its `pagellm_matrix` struct (`_Matrix`), the
storage types the kernel takes, and `PackedMatmul`, which every caller multiplies through.

Packed weights arrive as uint8 tensors [rows, bytes per row], each row a run of ggml blocks, exactly as in the
file. `PackedMatmul` rewrites block types once into the kernel's interleaved layout (rows in groups of four, the
same bytes in another order: see ggml_blocks.h), so everything that reads the weight afterwards goes through it.
"""
from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagellm import envs
from pagellm.kernels.build import Signature, load_library

SOURCE = Path(__file__).with_name("linear_cpu.c")
# No -march=native: the AVX2 functions carry their own target attribute and are chosen at run time, so the
# scalar path stays a true fallback. -ffp-contract=off keeps ggml's two roundings in `d * q + m`.
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p

T = GGMLQuantizationType
# Storage types the kernel multiplies with directly; those made of 32-weight blocks are stored interleaved.
BLOCK_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL})
SUPPORTED_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS}) | BLOCK_TYPES


# Every exported function of linear_cpu.c (its .inc fragments export none), under the prototype it mirrors
# (tests/kernels/test_bindings.py checks both ways). decoder_cpu.c calls pagellm_matmul through its matmul_fn.
SIGNATURES: dict[str, Signature] = {
    # int pagellm_cpu_has_avx2(void);
    "pagellm_cpu_has_avx2": (_INT, []),
    # int pagellm_cpu_has_avx512(void);
    "pagellm_cpu_has_avx512": (_INT, []),
    # int pagellm_dequantize_rows(const pagellm_matrix *w, const int64_t *ids, int64_t count, float *out,
    #                             int nthreads);
    "pagellm_dequantize_rows": (_INT, [_PTR, _PTR, _I64, _PTR, _INT]),
    # int64_t pagellm_interleave(int type, const uint8_t *src, int64_t n, int64_t row_bytes, uint8_t *dst);
    "pagellm_interleave": (_I64, [_INT, _PTR, _I64, _I64, _PTR]),
    # int pagellm_matmul(const pagellm_matrix *w, const float *x, int64_t m, int64_t ldx, float *out, int nthreads);
    "pagellm_matmul": (_INT, [_PTR, _PTR, _I64, _I64, _PTR, _INT]),
}


@cache
def load() -> ctypes.CDLL | None:
    return load_library(SOURCE, _FLAGS, "packed-weight linear layers", SIGNATURES)


def loaded() -> ctypes.CDLL:
    """The library, for callers that know it loads (they checked `load()` or `available()` first)."""
    library = load()
    assert library is not None, "check load() first and use the PyTorch path when it returns None"
    return library


def available() -> bool:
    return load() is not None


@cache
def use_avx2() -> bool:
    """AVX2+FMA+F16C when the CPU has them, unless PAGELLM_CPU_ISA=scalar asks for the portable path."""
    return envs.cpu_isa() != "scalar" and bool(loaded().pagellm_cpu_has_avx2())


@cache
def use_avx512() -> bool:
    """The AVX-512F variants of the tile path and of the small-M float32-activation kernels (the same floats as
    AVX2's, twice as wide) when the CPU has AVX-512F, unless PAGELLM_CPU_ISA asks for avx2 or scalar."""
    return envs.cpu_isa() not in ("scalar", "avx2") and bool(loaded().pagellm_cpu_has_avx512())


def row_bytes(qtype: int, columns: int) -> int:
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if columns % block_elems:
        raise ValueError(f"{GGMLQuantizationType(qtype).name} rows hold a multiple of {block_elems} values, "
                         f"got {columns}.")
    return columns // block_elems * block_bytes


def _check(status: int, what: str) -> None:
    if status == -2:
        raise MemoryError(f"{what}: could not allocate a tile buffer")
    if status != 0:
        raise ValueError(f"{what}: unsupported weight type or shape")


# Mirrors linear_cpu.c's pagellm_matrix, field for field.
class _Matrix(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("use_avx2", ctypes.c_int32), ("int8_activations", ctypes.c_int32),
                ("use_avx512", ctypes.c_int32), ("w", _PTR), ("row_bytes", _I64),
                ("n", _I64), ("k", _I64), ("grouped_rows", _I64), ("num_parts", _I64), ("parts", _PTR)]


class PackedMatmul:
    """x -> x W^T for one packed weight, described to the kernel once so each call passes six arguments; the
    decode step calls it about a hundred times, so its Python cost is kept to a few microseconds. Block types are
    rewritten into the interleaved layout here: `weight` is then the only copy, and `dequantize` /
    `dequantize_rows` read it."""

    __slots__ = ("weight", "parts", "in_features", "out_features", "_matrix", "_part_matrices", "pointer", "_run")

    def __init__(self, qweight: torch.Tensor, qtype: int, in_features: int) -> None:
        if qweight.shape[1] != row_bytes(qtype, in_features):
            raise ValueError(f"packed rows of {qweight.shape[1]} bytes do not hold {in_features} "
                             f"{GGMLQuantizationType(qtype).name} values")
        grouped_rows = 0
        if qtype in BLOCK_TYPES:
            plain = qweight.contiguous()
            qweight = torch.empty_like(plain)
            grouped_rows = loaded().pagellm_interleave(int(qtype), plain.data_ptr(), plain.shape[0], plain.shape[1],
                                                       qweight.data_ptr())
        self.weight: torch.Tensor | None = qweight  # keeps the memory the kernel reads alive (None: a stack)
        self.parts: tuple[PackedMatmul, ...] = ()
        self._part_matrices: ctypes.Array[_Matrix] | None = None  # a stack's copies of its parts' descriptors
        self.in_features, self.out_features = in_features, qweight.shape[0]
        self._matrix = _Matrix(int(qtype), int(use_avx2()), 0, int(use_avx512()), qweight.data_ptr(),
                               qweight.stride(0), qweight.shape[0], in_features, grouped_rows, 0, None)
        self.pointer = ctypes.addressof(self._matrix)  # what the fused decoder (kernels.decoder) passes to C
        self._run = loaded().pagellm_matmul

    @classmethod
    def stack(cls, parts: list[PackedMatmul]) -> PackedMatmul:
        """Matrices of one input stacked along the output, each in its own storage type (a fused q|k|v whose v the
        file stores in another type than q and k): one call computes them all, in order."""
        if len({p.in_features for p in parts}) != 1 or any(p.parts for p in parts):
            raise ValueError("stacked matrices take the same input and are not stacks themselves")
        stacked = cls.__new__(cls)
        stacked.weight, stacked.parts = None, tuple(parts)
        stacked.in_features, stacked.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        part_matrices = (_Matrix * len(parts))(*(p._matrix for p in parts))  # copies the C side reads
        stacked._part_matrices = part_matrices
        stacked._matrix = _Matrix(0, 0, 0, 0, None, 0, stacked.out_features, stacked.in_features, 0, len(parts),
                                  ctypes.addressof(part_matrices))
        stacked.pointer = ctypes.addressof(stacked._matrix)
        stacked._run = loaded().pagellm_matmul
        return stacked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # the C side reads raw float32 memory
            raise TypeError(f"PackedMatmul takes float32 activations, got {x.dtype}")
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
        status = self._run(self.pointer, x2.data_ptr(), x2.shape[0], x2.stride(0), out.data_ptr(),
                           torch.get_num_threads())
        if status:
            _check(status, "matmul")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    @property
    def int8_activations(self) -> bool:
        """Whether products round the activations to int8 first (llama.cpp's arithmetic, linear_int8.inc), instead
        of the exact float32 default: K-quants at every length (prefill too), the 32-weight types up to 48 activation
        rows (decode). Float weights ignore it."""
        return bool(self._matrix.int8_activations)

    @int8_activations.setter
    def int8_activations(self, on: bool) -> None:
        self._matrix.int8_activations = int(on)
        if self._part_matrices is None:
            return
        for i, part in enumerate(self.parts):  # a stack's C side reads its copies of the parts
            part.int8_activations = on
            self._part_matrices[i].int8_activations = int(on)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32 [*ids.shape, in_features] (an embedding lookup), exactly as ggml dequantizes."""
        if self.parts:
            return self.dequantize()[ids]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.shape[0], self.in_features, dtype=torch.float32)
        _check(loaded().pagellm_dequantize_rows(self.pointer, flat.data_ptr(), flat.shape[0], out.data_ptr(),
                                                torch.get_num_threads()), "dequantize")
        return out.view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32 [out_features, in_features]."""
        if self.parts:
            return torch.cat([part.dequantize() for part in self.parts])
        return self.dequantize_rows(torch.arange(self.out_features))
