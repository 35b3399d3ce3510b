"""The gated MLP every supported family uses: act(x W_gate) * (x W_up), then W_down, with gate|up fused into one
column-parallel matmul and down row-parallel (each rank holds a slice of the intermediate dimension). The
activation is the family's: SiLU (Llama, Qwen, Phi-3, the MoE experts), tanh-GELU (Gemma 3)."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: nn.Module, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the sum over ranks (a mixture of experts sums once, after
        adding its experts)."""
        return self.down_proj.matmul(self.act(self.gate_up_proj(x)))
