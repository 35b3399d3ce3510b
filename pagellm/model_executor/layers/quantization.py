"""Weight storage formats: `PackedTensor` (a matrix as GGUF stores it, rows of ggml blocks) and the
`--quantization` methods that decide which linear layers keep their weights packed.

- "gguf": GGUF files keep every supported block type packed (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, IQ4_NL,
  IQ4_XS, F16, BF16) and the CPU kernels multiply with it directly; other types (the other IQ types) are
  dequantized to float32 when loaded.
- "int8": float checkpoints are quantized to Q8_0 (int8 with one float16 scale per 32 weights) when loaded.
- "none": every weight is dequantized to the model dtype.

Independently, `--quantize-activations` gives packed weights llama.cpp's arithmetic (int8 activations,
kernels/linear_int8.inc): K-quants in every matmul, the 32-weight types in matmuls of up to 48 rows; faster, no
longer exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

QUANTIZATION_METHODS = ("gguf", "int8", "none")


@dataclass(slots=True)
class PackedTensor:
    """A 2-D weight [rows, columns] stored as `qtype`: uint8 `data` [rows, bytes per row], exactly as in GGUF."""
    qtype: GGMLQuantizationType
    data: torch.Tensor
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, columns], exactly as ggml (and transformers' GGUF loader) dequantizes."""
        values = quants.dequantize(self.data.numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)


def quantize_q8_0(weight: torch.Tensor) -> PackedTensor:
    """A float matrix as Q8_0 blocks (`--quantization int8`); its columns must be a multiple of 32."""
    values = weight.detach().float().cpu().numpy()
    blocks = quants.quantize(values, GGMLQuantizationType.Q8_0)
    return PackedTensor(GGMLQuantizationType.Q8_0, torch.from_numpy(blocks.view(np.uint8).reshape(values.shape[0], -1)),
                        tuple(values.shape))
