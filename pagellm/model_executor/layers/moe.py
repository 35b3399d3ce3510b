"""Mixture-of-experts MLP: a router scores every expert for each token, the top k run, and their outputs are summed
with the router's weights.

The experts run grouped, not token by token: the step's (token, expert) pairs are sorted by expert, and each expert
that received tokens multiplies all of them at once, so its matmul gets many rows (the packed kernels' multi-row
path, or one GEMM) and an expert nobody chose costs nothing. Each expert is an ordinary gate|up and down projection
pair, so float and packed GGUF weights load as they do for a dense MLP. Under tensor parallelism every rank holds a
slice of every expert's intermediate dimension, as in a dense MLP, and the summed output is all-reduced once.
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed.parallel_state import get_tp_group
from pagellm.model_executor.layers.activation import SiluAndMul
from pagellm.model_executor.layers.linear import Linear
from pagellm.model_executor.layers.mlp import GatedMLP


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, experts [T, k]): the softmax over all experts, its k largest, rescaled to sum to one
    when `renormalize` (Mixtral always; Qwen3-MoE when its config's norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class MixtureOfExperts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and num_experts ({num_experts}).")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = Linear(hidden_size, num_experts)  # the router, whole on every rank
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size, SiluAndMul()) for _ in range(num_experts))
        self.tp = get_tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        # Sort the (token, expert) pairs by expert: each expert's tokens are then one contiguous run.
        order = torch.argsort(experts.flatten(), stable=True)
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order].unsqueeze(1)
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = tokens[start:start + count]
                partial = expert.partial(x.index_select(0, rows))
                out.index_add_(0, rows, partial.float() * pair_weights[start:start + count])
                start += count
        return self.tp.all_reduce(out.to(x.dtype))
