"""Linear layers that know how to load checkpoint weights, including fused (stacked) projections.

Fusing q/k/v and gate/up into one matmul each halves the number of kernel launches per layer.
"""
from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension (q|k|v, gate|up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start, size = self.offsets[shard], self.output_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"Checkpoint shard {shard} has {loaded.shape[0]} rows, expected {size}.")
        param.data[start:start + size].copy_(loaded)
