"""Batched token sampling: per-request parameters as tensors, one pass over the batch.

Greedy rows take the argmax of the raw logits, so they stay exact next to sampled rows. Sampled rows draw with
the exponential-race trick (argmax of p / q, q ~ Exp(1)), which needs no sort; a request with a seed draws its
q from its own generator, so its tokens do not depend on the rest of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64; vocab size where disabled
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    # row -> generator, for requests with a seed
    generators: dict[int, torch.Generator]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k and its top-p nucleus. Ties at the boundary are kept."""
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    threshold = sorted_logits[:, :1].clone().fill_(float("-inf"))
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k.clamp(1, logits.shape[-1]) - 1).unsqueeze(1))
        threshold = torch.maximum(threshold, kth)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass strictly before it is below top_p; the first token is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        outside = mass_before >= top_p.unsqueeze(1)
        outside[:, 0] = False
        last_kept = sorted_logits.masked_fill(outside, float("inf")).min(dim=-1, keepdim=True).values
        threshold = torch.maximum(threshold, last_kept)
    return logits.masked_fill(logits < threshold, float("-inf"))


class Sampler:
    def __call__(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        """logits: [B, V] float32. Returns the sampled token ids, [B] int64."""
        greedy_tokens = logits.argmax(dim=-1)
        if tensors.all_greedy:
            return greedy_tokens
        greedy = tensors.temperature == 0
        logits = logits / torch.where(greedy, 1.0, tensors.temperature).unsqueeze(1)
        if tensors.needs_top_k or tensors.needs_top_p:
            logits = apply_top_k_top_p(logits, tensors.top_k if tensors.needs_top_k else None,
                                       tensors.top_p if tensors.needs_top_p else None)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for row, generator in tensors.generators.items():
            q[row].exponential_(generator=generator)
        sampled = probs.div_(q).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)
