"""Gated activations."""
import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import elementwise


class SiluAndMul(nn.Module):
    """silu(gate) * up, for the fused [gate | up] projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if elementwise.applies(x) and x.is_contiguous():
            return elementwise.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate) * up with the tanh approximation (Gemma's gelu_pytorch_tanh), for the fused [gate | up] output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if elementwise.applies(x) and x.is_contiguous():
            return elementwise.gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
