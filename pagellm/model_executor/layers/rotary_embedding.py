"""Rotary position embeddings (neox / rotate-half layout, as in Hugging Face Llama), with a precomputed cache.

Inverse frequencies come from transformers' own RoPE initialisers, so scaled variants (linear, llama3, yarn, ...)
match the reference implementation exactly.
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import elementwise

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if not params:  # older transformers configs
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}.")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotation tables for every position: `tables(positions, hidden)` once per forward, `forward` in each layer."""

    def __init__(self, hf_config, head_dim: int, max_position: int) -> None:
        super().__init__()
        # Computed on the CPU, then moved to the device the model is being built on (the loader's `torch.device`
        # context): transformers' initialisers return CPU tensors, and every device gets the same tables.
        device = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
            freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
            cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
            # Full-width rows, sine signed for rotate-half: x * cos + rotate_half(x) * sin is one cat and two
            # products.
            cos_cache, sin_cache = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        self.register_buffer("cos_cache", cos_cache.to(device), persistent=False)
        self.register_buffer("sin_cache", sin_cache.to(device), persistent=False)

    def tables(self, positions: torch.Tensor,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(positions, cos, sin), cos and sin [T, 1, head_dim]: gathered once per forward pass for every layer,
        or None when the C kernel applies to these activations (it reads the full tables by position)."""
        if elementwise.applies(hidden):
            return positions, None, None
        return positions, self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def forward(self, tables: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]. The C path rotates them in place."""
        positions, cos, sin = tables
        if cos is None and q.stride(-1) == 1 and k.stride(-1) == 1:
            elementwise.rope_(q, positions, self.cos_cache, self.sin_cache)
            elementwise.rope_(k, positions, self.cos_cache, self.sin_cache)
            return q, k
        if cos is None:
            cos, sin = self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin).to(dtype)
