"""A GGUF file's tensors under Hugging Face names, matrices kept packed (`PackedTensor`) as the file stores them.

The file is read with one sequential read (mapped, for a rank that keeps a slice: see file_reader.py), and each
tensor is found through the index the converter wrote beside the checkpoint (`gguf_loader.gguf_tensor_index`), which
also says how it becomes the Hugging Face tensor: no metadata parsing at load. Rows of ggml blocks are independent,
so llama.cpp's Q/K row permutation (where the index names one) is undone on the packed bytes, fused projections
can stack packed shards, and a tensor stacking every expert's matrix (MoE) splits into one packed matrix per expert.
Float32 matrices and 1-D tensors (norms) come as float32 tensors.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator

import torch
from gguf import GGMLQuantizationType, quants

from pagellm.model_executor.layers.quantization import PackedTensor
from pagellm.model_executor.model_loader.file_reader import read_file
from pagellm.model_executor.model_loader.gguf_loader import (
    expert_names,
    gguf_source,
    gguf_tensor_index,
    unpermute_rows,
)


def iterate_gguf_weights(model_dir: str | os.PathLike,
                         mapped: bool = False) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    """(Hugging Face name, tensor) for every weight of the GGUF file `model_dir` was converted from (the file read
    or mapped as `read_file` does)."""
    index = gguf_tensor_index(model_dir)
    buffer = read_file(gguf_source(model_dir), mapped)
    for entry in index:
        qtype = GGMLQuantizationType(entry["type"])
        shape = tuple(reversed(entry["shape"]))  # GGUF lists dimensions innermost first
        raw = buffer[entry["offset"]:entry["offset"] + entry["bytes"]]
        names = expert_names(entry["hf_name"], entry["experts"])
        if entry["experts"] and (len(shape) != 3 or shape[0] != entry["experts"]):
            raise ValueError(f"GGUF tensor {entry['name']!r} of shape {shape} does not stack {len(names)} experts")
        parts: list[torch.Tensor | PackedTensor]
        if len(shape) >= 2 and qtype != GGMLQuantizationType.F32:
            # [experts x] rows of blocks: each expert's matrix is a run of whole rows
            rows = raw.view(math.prod(shape[:-1]), -1)
            parts = [PackedTensor(qtype, part, (part.shape[0], shape[-1])) for part in rows.chunk(len(names))]
        else:  # norms (and float32 matrices): float32, as the gguf package dequantizes them
            weight = torch.from_numpy(quants.dequantize(raw.numpy(), qtype)).reshape(shape) + entry["value_offset"]
            parts = list(weight) if entry["experts"] else [weight]
        permute_heads = entry["unpermute_heads"]
        for name, part in zip(names, parts, strict=True):
            if permute_heads and isinstance(part, PackedTensor):
                part.data = unpermute_rows(part.data, permute_heads)
            elif permute_heads:
                part = unpermute_rows(part, permute_heads)
            yield name, part
