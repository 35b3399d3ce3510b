"""Rotary position embeddings (neox / rotate-half layout, as in Hugging Face Llama), with a precomputed cache.

Inverse frequencies come from transformers' own RoPE initialisers, so scaled variants (linear, llama3, yarn, ...)
match the reference implementation exactly. A model may rotate only the first `partial_rotary_factor` of each head
(Phi-4-mini), and may give each kind of layer its own parameters (Gemma 3's sliding and full attention layers:
`layer_type`).
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import elementwise

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The RoPE parameters (of layers of `layer_type`, where the config gives each kind of layer its own)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
    if not params:  # older transformers configs
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rotary_dim(hf_config, head_dim: int, layer_type: str | None = None) -> int:
    """How many leading dimensions of each head rotate (the rest pass through)."""
    factor = rope_parameters(hf_config, layer_type).get("partial_rotary_factor",
                                                        getattr(hf_config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def longrope_limit(hf_config) -> int | None:
    """The longest context rotated exactly under the config's LongRoPE scaling (its short factors reach
    original_max_position_embeddings; see models/phi3.py); None without LongRoPE."""
    params = rope_parameters(hf_config)
    if params["rope_type"] != "longrope":
        return None
    return int(params.get("original_max_position_embeddings")
               or getattr(hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings)


def compute_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        dim = rotary_dim(hf_config, head_dim, layer_type)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}.")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), layer_type=layer_type)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotation tables for every position: `tables(positions, hidden)` once per forward, `forward` in each layer."""

    def __init__(self, hf_config, head_dim: int, max_position: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim(hf_config, head_dim, layer_type)
        # Computed on the CPU, then moved to the device the model is being built on (the loader's `torch.device`
        # context): transformers' initialisers return CPU tensors, and every device gets the same tables.
        device = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq, scaling = compute_inv_freq(hf_config, head_dim, layer_type)
            freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
            cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
            # Full-width rows, sine signed for rotate-half: x * cos + rotate_half(x) * sin is one cat and two
            # products.
            cos_cache, sin_cache = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        self.register_buffer("cos_cache", cos_cache.to(device), persistent=False)
        self.register_buffer("sin_cache", sin_cache.to(device), persistent=False)

    def tables(self, positions: torch.Tensor,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(positions, cos, sin), cos and sin [T, 1, rotary_dim]: gathered once per forward pass for every layer,
        or None when the C kernel applies to these activations (it reads the full tables by position; it rotates
        whole heads)."""
        if elementwise.applies(hidden) and self.rotary_dim == self.head_dim:
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
        if self.rotary_dim < self.head_dim:
            return self._rotate_partly(q, cos, sin), self._rotate_partly(k, cos, sin)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _rotate_partly(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated, passed = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat((_rotate(rotated, cos, sin), passed), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin).to(dtype)
