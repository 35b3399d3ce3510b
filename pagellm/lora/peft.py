"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) and checking it
against the base model's shapes, so a wrong adapter is refused with a message naming the problem.

Supported: LoRA on the attention and MLP projections (q/k/v/o_proj, gate/up/down_proj), `lora_alpha / r` scaling
or `lora_alpha / sqrt(r)` with `use_rslora`. Refused: DoRA, per-module rank or alpha patterns, bias training,
modules_to_save, fan_in_fan_out, and any other target module."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

# PEFT's projection names and the (input, output) sizes each has in the base model.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.(.+)\.(\w+_proj)\.lora_([AB])\.weight$")


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(input, output) features of each projection, from the base model's config."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass
class PEFTAdapter:
    path: str
    rank: int
    scaling: float
    # (module path, e.g. "model.layers.0.self_attn", projection) -> (A [r, in], B [out, r]) in float32
    weights: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]
    base_model_name_or_path: str | None


def _refuse(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {what}")


def read_config(path: str, max_rank: int) -> dict:
    """adapter_config.json, checked: a LoRA whose rank fits `max_rank` and whose features pagellm runs."""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise _refuse(path, "adapter_config.json is missing (a PEFT adapter directory is expected).")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type is {config.get('peft_type')}; only LORA adapters are supported.")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(path, f"r must be a positive integer, got {rank!r}.")
    if rank > max_rank:
        raise _refuse(path, f"its rank r={rank} is above --max-lora-rank {max_rank}; raise --max-lora-rank.")
    for key, supported in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key) not in (None, supported):
            raise _refuse(path, f"{key}={config[key]!r} is not supported (only {supported!r}).")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _refuse(path, f"{key} is not supported (it must be empty).")
    targets = config.get("target_modules") or []
    unknown = sorted({targets} if isinstance(targets, str) else set(targets) - set(PROJECTIONS))
    if unknown:
        raise _refuse(path, f"target module(s) {', '.join(unknown)} not supported: this model's adapters may target "
                            f"{', '.join(PROJECTIONS)}.")
    return config


def load_peft_adapter(path: str, hf_config, max_rank: int) -> PEFTAdapter:
    """The adapter's weights, checked against `hf_config`'s projection shapes and layer count. Raises ValueError
    naming the problem."""
    config = read_config(path, max_rank)
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise _refuse(path, "adapter_model.safetensors is missing.")
    rank = config["r"]
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes = projection_shapes(hf_config)
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_file).items():
        match = _KEY.match(key)
        if match is None:
            raise _refuse(path, f"tensor {key} is not a LoRA A/B weight of a supported projection.")
        module, projection, which = match.groups()
        parts.setdefault((module, projection), {})[which] = tensor.float()
    weights = {}
    for (module, projection), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"{module}.{projection} has lora_{''.join(ab)} but not both lora_A and lora_B.")
        layer = re.search(r"layers\.(\d+)\.", module + ".")
        if layer is None or int(layer.group(1)) >= hf_config.num_hidden_layers:
            raise _refuse(path, f"{module}.{projection}: this model has no such layer (it has "
                                f"{hf_config.num_hidden_layers}); the adapter was made for another base model.")
        expected_in, expected_out = shapes[projection]
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, expected_in) or b.shape != (expected_out, rank):
            raise _refuse(path, f"{module}.{projection} has A {tuple(a.shape)} and B {tuple(b.shape)}, but this base "
                                f"model needs A ({rank}, {expected_in}) and B ({expected_out}, {rank}): the adapter "
                                f"was made for another base model.")
        weights[(module, projection)] = (a, b)
    if not weights:
        raise _refuse(path, "adapter_model.safetensors holds no LoRA weights.")
    return PEFTAdapter(path, rank, scaling, weights, config.get("base_model_name_or_path"))


def write_random_adapter(path: str, hf_config, rank: int, seed: int = 0, scale: float = 0.02) -> str:
    """A PEFT LoRA adapter directory of `hf_config`'s shapes on every projection, random A and B (for benchmarks)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for projection, (features_in, features_out) in projection_shapes(hf_config).items():
            block = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            module = f"base_model.model.model.layers.{layer}.{block}"
            for which, shape in (("A", (rank, features_in)), ("B", (features_out, rank))):
                tensors[f"{module}.{projection}.lora_{which}.weight"] = torch.randn(shape, generator=generator) * scale
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}, f)
    return path
