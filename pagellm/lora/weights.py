"""An adapter laid out on the model's layers: one (A, B) pair per linear layer it changes, in float32. Fused layers
(q|k|v, gate|up) stack their projections' A's along the rank and place each B in its own rows and rank columns
(block diagonal), so one pair of matmuls serves the whole fused layer; `scaling` is folded into B. The blocks are
named (`parts`), so the fused CPU decode step (kernels/decoder_cpu.c) reads only them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagellm.lora.peft import PEFTAdapter
from pagellm.model_executor.layers.linear import Linear

# PEFT projection -> (pagellm layer name, its shard in that layer)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "o_proj": ("o_proj", 0), "down_proj": ("down_proj", 0)}


@dataclass(frozen=True)
class LoRALayerWeights:
    a: torch.Tensor  # A: [rank total, input features], the parts' A's stacked
    b_t: torch.Tensor  # (scaling B)^T: [rank total, output features], block-diagonal
    # per part, in rank order: (its rank, its first output feature, its output features)
    parts: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class StackedLoRA:
    """Several adapters' weights for one layer side by side: `owner[j]` is the adapter (its position in the set)
    that rank column j belongs to."""
    a_t: torch.Tensor  # [input features, ranks of all] (a transposed view of the A's)
    b_t: torch.Tensor  # [ranks of all, output features]
    owner: torch.Tensor  # [ranks of all], int64


@dataclass(frozen=True)
class LoRAModel:
    lora_int_id: int
    layers: dict[nn.Module, LoRALayerWeights]  # keyed by the model's layer objects


def build_lora_model(lora_int_id: int, adapter: PEFTAdapter, model: nn.Module, device: torch.device) -> LoRAModel:
    """Place `adapter` on `model`'s linear layers (one rank: the layers' sizes are the checkpoint's)."""
    by_layer: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (module, projection), ab in adapter.weights.items():
        name, shard = _FUSED[projection]
        # PEFT names the Hugging Face model ("model.layers.0.self_attn"); pagellm's model holds "layers" itself.
        by_layer.setdefault(f"{module.removeprefix('model.')}.{name}", {})[shard] = ab
    layers = {}
    for name, shards in by_layer.items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"LoRA adapter {adapter.path}: this model has no layer {name}.") from None
        if not isinstance(layer, Linear):
            raise ValueError(f"LoRA adapter {adapter.path}: {name} is not a linear layer in this model.")
        offsets = getattr(layer, "offsets", [0])
        sizes = getattr(layer, "output_sizes", [layer.output_size])
        a = torch.cat([shards[i][0] for i in sorted(shards)])
        b = torch.zeros(layer.output_size, a.shape[0])
        col, parts = 0, []
        for i in sorted(shards):
            part = shards[i][1]
            if part.shape[0] != sizes[i]:
                raise ValueError(f"LoRA adapter {adapter.path}: {name} shard {i} has {sizes[i]} rows, the adapter's "
                                 f"B has {part.shape[0]}.")
            b[offsets[i]:offsets[i] + sizes[i], col:col + part.shape[1]] = part * adapter.scaling
            parts.append((part.shape[1], offsets[i], sizes[i]))
            col += part.shape[1]
        layers[layer] = LoRALayerWeights(a.contiguous().to(device), b.T.contiguous().to(device), tuple(parts))
    return LoRAModel(lora_int_id, layers)


def stack_adapters(adapters: tuple[LoRAModel, ...], layer: nn.Module) -> StackedLoRA | None:
    """`adapters`' weights for `layer` side by side (None when none of them changes it)."""
    parts = [(i, adapter.layers[layer]) for i, adapter in enumerate(adapters) if layer in adapter.layers]
    if not parts:
        return None
    if len(parts) == 1:
        i, weights = parts[0]
        owner = torch.full((weights.a.shape[0],), i, dtype=torch.int64, device=weights.a.device)
        return StackedLoRA(weights.a.T, weights.b_t, owner)
    owner = torch.cat([torch.full((w.a.shape[0],), i, dtype=torch.int64, device=w.a.device) for i, w in parts])
    return StackedLoRA(torch.cat([w.a for _, w in parts]).T, torch.cat([w.b_t for _, w in parts]).contiguous(), owner)
