"""Storing checkpoint tensors in a model's parameters, for every model family.

Tensors arrive under Hugging Face names. A family's `stacked_params` maps the fragments of projections it fuses
(q/k/v into qkv_proj, gate/up into gate_up_proj) to the fused parameter and the shard index; the fused layer stores
its matrix once every shard is in. Matrices go through their layer's `load_weight` (which may keep them packed: see
layers/quantization.py); other tensors are copied after a shape check. Anything left unfilled is an error naming it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagellm.model_executor.layers.linear import ColumnParallelLinear, Linear
from pagellm.model_executor.layers.quantization import PackedTensor

# checkpoint name fragment -> (fused parameter fragment, shard index)
StackedParams = dict[str, tuple[str, int]]

# How Hugging Face checkpoints name the projections the models here fuse (Llama's names, which most families share).
FUSED_QKV_GATE_UP: StackedParams = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | PackedTensor]], quantization: str,
                 stacked_params: StackedParams, skip: Callable[[str], bool]) -> set[str]:
    """Store each checkpoint tensor (names without the leading "model.") in `model`'s parameters; `skip(name)`
    drops tensors the model does not hold here (another pipeline stage's, a tied LM head). Returns the names
    loaded; raises if a tensor has no parameter or a parameter got no tensor."""
    params = dict(model.named_parameters())
    loaded = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name or skip(name):
            continue
        fragment = next((f for f in stacked_params if f".{f}." in name), None)
        if fragment is not None:
            fused, shard = stacked_params[fragment]
            name = name.replace(f".{fragment}.", f".{fused}.")
        module_name, _, kind = name.rpartition(".")
        if name not in params:
            raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}.")
        module = model.get_submodule(module_name)
        try:
            if fragment is not None and kind == "weight":
                module.load_shard(tensor, shard, quantization)
            elif fragment is not None:
                module.load_bias_shard(tensor, shard)
            elif kind == "weight" and isinstance(module, Linear):
                module.load_weight(tensor, quantization)
            elif params[name].shape != tensor.shape:
                raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}.")
            else:
                params[name].data.copy_(tensor)
        except ValueError as exc:
            raise ValueError(f"Checkpoint tensor {name!r}: {exc}") from exc
        loaded.add(name)
    missing = set(params) - loaded
    missing |= {f"{module_name}.weight (some of its shards)" for module_name, module in model.named_modules()
                if isinstance(module, ColumnParallelLinear) and module.has_pending_shards}
    if missing:
        raise ValueError(f"Checkpoint is missing weights: {sorted(missing)[:8]}")
    return loaded
