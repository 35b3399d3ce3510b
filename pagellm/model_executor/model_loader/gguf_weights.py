"""A GGUF file's tensors under Hugging Face names, matrices kept packed (`PackedTensor`) as the file stores them.

Rows of ggml blocks are independent, so llama.cpp's Q/K row permutation is undone on the packed bytes and
fused projections can stack packed shards. Float32 matrices and 1-D tensors (norms) come as float32 tensors.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagellm.model_executor.layers.quantization import PackedTensor
from pagellm.model_executor.model_loader.gguf_loader import (ROPE_FREQS, dequantize_tensor, hf_tensor_name,
                                                             unpermute_rows)


def iterate_gguf_weights(path: str | os.PathLike, hf_config) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    reader = gguf.GGUFReader(path)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weight: torch.Tensor | PackedTensor
        if len(shape) == 2 and tensor.tensor_type != GGMLQuantizationType.F32:
            rows = np.array(np.asarray(tensor.data).view(np.uint8).reshape(shape[0], -1))  # a copy: off the mmap
            weight = PackedTensor(GGMLQuantizationType(tensor.tensor_type), torch.from_numpy(rows), shape)
        else:
            weight = dequantize_tensor(tensor).float()
        permute_heads = heads if ".attn_q." in tensor.name else kv_heads if ".attn_k." in tensor.name else 0
        if permute_heads and isinstance(weight, PackedTensor):
            weight.data = unpermute_rows(weight.data, permute_heads)
        elif permute_heads:
            weight = unpermute_rows(weight, permute_heads)
        yield hf_tensor_name(tensor.name), weight
