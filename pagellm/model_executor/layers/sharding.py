"""The part of a checkpoint matrix one tensor-parallel rank keeps: row and column slices of float tensors and of
packed GGUF matrices (`PackedTensor`: rows of ggml blocks), and the size checks that go with them.

A slice that is the whole matrix is returned as it is, so one rank (tp == 1) loads exactly what it loaded before
tensor parallelism existed. A packed slice is copied out of the file buffer it views, so a rank does not keep the
whole file alive for its share.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES

from pagellm.model_executor.layers.quantization import PackedTensor

Weight = torch.Tensor | PackedTensor


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"The {what} ({numerator}) is not divisible by the tensor parallel size ({denominator}); "
                         f"pick a --tensor-parallel-size that divides it.")
    return numerator // denominator


def check_shape(loaded: Weight, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"Checkpoint matrix has shape {tuple(loaded.shape)}, expected {expected}.")


def narrow_rows(loaded: Weight, start: int, size: int) -> Weight:
    """Rows [start, start + size)."""
    if start == 0 and size == loaded.shape[0]:
        return loaded
    if isinstance(loaded, PackedTensor):
        return PackedTensor(loaded.qtype, loaded.data[start:start + size].clone(), (size, loaded.shape[1]))
    return loaded[start:start + size]


def narrow_columns(loaded: Weight, start: int, size: int) -> Weight:
    """Columns [start, start + size). A packed matrix stays packed when the slice falls on ggml block boundaries;
    otherwise a block would straddle two ranks, so the matrix is dequantized and the rank keeps float32 columns
    (more memory than packed, same values)."""
    if start == 0 and size == loaded.shape[1]:
        return loaded
    if not isinstance(loaded, PackedTensor):
        return loaded[:, start:start + size]
    block_values, block_bytes = GGML_QUANT_SIZES[loaded.qtype]
    if start % block_values or size % block_values:
        return loaded.dequantize()[:, start:start + size]
    byte_start, byte_size = start // block_values * block_bytes, size // block_values * block_bytes
    columns = loaded.data[:, byte_start:byte_start + byte_size]
    return PackedTensor(loaded.qtype, columns.clone(memory_format=torch.contiguous_format), (loaded.shape[0], size))
