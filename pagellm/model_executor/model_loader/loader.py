"""Build a model on its device and fill it from a checkpoint directory's safetensors files."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagellm.config import ModelConfig
from pagellm.model_executor.models.registry import get_model_class


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


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    model_class = get_model_class(model_config.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = model_class(model_config.hf_config, max_position=model_config.max_model_len)
    finally:
        torch.set_default_dtype(default_dtype)
    model.load_weights(iterate_weights(model_config.model))
    return model.eval().requires_grad_(False)
