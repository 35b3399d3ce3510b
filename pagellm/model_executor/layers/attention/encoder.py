"""Bidirectional attention for encoder-only models (BERT): each token attends to every token of its own prompt, and
no K/V is written to or read from a cache.

The engine runs an encoder's prompt whole in one step (it turns chunked prefill and prefix caching off for encoders,
and the worker allocates no KV cache for them: see engine/config_builder.py and worker/worker.py), so every sequence of
the flat batch is one prefill chunk of the step's metadata, with no cached context. A one-token prompt is laid out
as a decode row (the model runner puts single-token queries first): its attention is its own value. One SDPA call
per sequence, so there is no padding and a sequence's result does not depend on its batch; whichever backend built
the metadata, its paged kernels are not called.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.model_executor.layers.attention.backend import AttentionMetadata


class EncoderAttention(nn.Module):
    """One layer's bidirectional attention over whole prompts; `scale` multiplies q.k (default head_dim^-0.5)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q, k, v: [T, H, D] over the flat batch. Returns [T, H * D]."""
        out = torch.empty_like(q)
        n = meta.num_decodes
        out[:n] = v[:n]  # one-token prompts: softmax over a single key
        for chunk in meta.prefills:
            if chunk.context_len:
                raise RuntimeError("An encoder-only model attends over whole prompts, but this chunk starts after "
                                   f"{chunk.context_len} computed tokens: chunked prefill and prefix caching must be "
                                   "off for encoders.")
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            q_seq, k_seq, v_seq = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D]
            attended = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, scale=self.scale)
            out[rows] = attended.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], q.shape[1] * q.shape[2])
