"""The `Attention` layer the models hold: the shapes of one attention and the call into the selected backend.

It owns nothing backend-specific: which kernels run, and what metadata they read, belong to the backend
`select_backend` picks for the queries' device and dtype (the same one the model runner built the metadata with).
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.model_executor.layers.attention.backend import AttentionMetadata
from pagellm.model_executor.layers.attention.selector import select_backend


class Attention(nn.Module):
    """One layer's attention. `sliding_window` (this layer's; None: the whole sequence): a query at position q sees
    the keys at q - sliding_window < k <= q, exactly transformers' sliding-window mask."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}.")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, Hkv, num_blocks, block_size, D]. Returns [T, H * D]."""
        return select_backend(q.device.type, q.dtype).forward(q, k, v, kv_cache, meta, self.scale,
                                                              self.sliding_window)
