"""The `Attention` layer the models hold: the shapes of one attention and the call into the selected backend.

It also reads a layer's sliding window from a model config (`layer_sliding_window`), and tells the layers their KV
cache groups (`assign_kv_groups`). It owns nothing backend-specific: which kernels run, and what metadata they read,
belong to the backend `select_backend` picks for the queries' device and dtype (the same one the model runner built
the metadata with).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from pagellm.model_executor.layers.attention.backend import AttentionMetadata
from pagellm.model_executor.layers.attention.selector import select_backend


def layer_sliding_window(config, index: int) -> int | None:
    """Layer `index`'s sliding window as transformers reads a config: `sliding_window` on the layers whose
    `layer_types` entry is "sliding_attention" (Gemma 3, Qwen2 past max_window_layers), or on every layer when the
    config lists no types (Mistral); None where it has none or `use_sliding_window` is false (Qwen2, Qwen3)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or layer_types[index] == "sliding_attention" else None



def layer_windows(config, num_layers: int) -> list[int | None]:
    """Every layer's sliding window (None: full attention), in order: what the KV cache groups are made of."""
    return [layer_sliding_window(config, index) for index in range(num_layers)]


class Attention(nn.Module):
    """One layer's attention. `sliding_window` (this layer's; None: the whole sequence): a query at position q sees
    the keys at q - sliding_window < k <= q, exactly transformers' sliding-window mask. `scale` multiplies q.k
    (default head_dim^-0.5; Gemma 3 uses query_pre_attn_scalar^-0.5)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 scale: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}.")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.kv_group = 0  # its KV cache group (set by `assign_kv_groups`): whose slots and block tables it reads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, Hkv, num_blocks, block_size, D]. Returns [T, H * D]."""
        if self.kv_group:
            meta = meta.kv_groups[self.kv_group - 1]
        return select_backend(q.device.type, q.dtype).forward(q, k, v, kv_cache, meta, self.scale,
                                                              self.sliding_window)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def assign_kv_groups(model: nn.Module, group_of_layer: dict[int, int]) -> None:
    """Tell each `Attention` of `model` (under `layers.<index>.`, as every family names its decoder layers) its
    layer's KV cache group."""
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise ValueError(f"Attention module {name!r} is not under a numbered decoder layer.")
            module.kv_group = group_of_layer[int(match.group(1))]
