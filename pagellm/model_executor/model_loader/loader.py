"""Build a model on its device and fill it from a checkpoint directory's safetensors files or its GGUF file."""
from __future__ import annotations

import json
import math
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagellm.config import ModelConfig
from pagellm.distributed.parallel_state import get_pp_group, get_tp_group
from pagellm.kernels import linear as linear_kernels
from pagellm.logger import init_logger
from pagellm.model_executor.layers.linear import quantize_activations
from pagellm.model_executor.model_loader.file_reader import read_file
from pagellm.model_executor.model_loader.gguf_loader import gguf_tensor_index
from pagellm.model_executor.model_loader.gguf_weights import iterate_gguf_weights
from pagellm.model_executor.models.registry import get_model_class

logger = init_logger(__name__)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise FileNotFoundError(f"No safetensors weights in {model_dir}" + (f": missing {missing}" if missing else "."))
    return files


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors(path: str | Path, mapped: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield a safetensors file's tensors as views of one buffer (see read_file)."""
    buffer = read_file(path, mapped)
    (header_len,) = struct.unpack("<Q", bytes(buffer[:8].tolist()))
    header = json.loads(bytes(buffer[8:8 + header_len].numpy()))
    data_start = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported safetensors dtype {info['dtype']!r}.")
        start, end = (data_start + offset for offset in info["data_offsets"])
        raw = buffer[start:end]
        if start % dtype.itemsize:  # the format does not promise alignment; a view needs it
            raw = raw.clone()
        yield name, raw.view(dtype).view(info["shape"])


def iterate_weights(model_dir: str | Path, mapped: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        yield from read_safetensors(path, mapped)


def _warn_unpacked_types(model_dir: str | Path) -> None:
    """Matrices in a type the kernels cannot multiply with (IQ1 to IQ3) are dequantized to float32 by their layers:
    say which, and what it costs in memory, rather than let a file take several times its size unexplained."""
    unpacked = [entry for entry in gguf_tensor_index(model_dir)
                if len(entry["shape"]) >= 2 and entry["type"] not in linear_kernels.SUPPORTED_TYPES]
    if unpacked:
        types = Counter(GGMLQuantizationType(entry["type"]).name for entry in unpacked)
        stored = sum(entry["bytes"] for entry in unpacked)
        expanded = sum(4 * math.prod(entry["shape"]) for entry in unpacked)
        logger.warning("No packed kernel for %s (%.1f MB in the file): dequantized to float32 at load (%.1f MB). "
                       "Q4_0 to Q8_0, Q2_K to Q6_K, IQ4_NL and IQ4_XS stay packed.",
                       ", ".join(f"{count} {name} matrices" for name, count in sorted(types.items())),
                       stored / 1e6, expanded / 1e6)


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """The model on `device`, its weights from the safetensors files, or packed from the GGUF file when
    `model_config.quantization` is "gguf"."""
    model_class = get_model_class(model_config.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = model_class(model_config.hf_config, max_position=model_config.max_model_len)
    finally:
        torch.set_default_dtype(default_dtype)
    if model_config.quantization != "none" and not linear_kernels.available():
        logger.warning("The C kernels for packed weights are unavailable (no C compiler, or "
                       "PAGELLM_DISABLE_C_KERNELS=1): weights are dequantized to float32 instead (--quantization %s).",
                       model_config.quantization)
    mapped = get_tp_group().world_size > 1 or get_pp_group().world_size > 1  # this rank keeps a slice
    if model_config.quantization == "gguf":
        if linear_kernels.available():
            _warn_unpacked_types(model_config.model)
        weights = iterate_gguf_weights(model_config.model, mapped)
    else:
        weights = iterate_weights(model_config.model, mapped)
    model.load_weights(weights, model_config.quantization)
    if model_config.quantize_activations:
        logger.info("int8 activations (--quantize-activations) for %d packed layers.", quantize_activations(model))
    return model.eval().requires_grad_(False)
