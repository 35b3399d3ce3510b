"""Batched token sampling: per-request parameters as tensors, one pass over the batch.

Order (vLLM's): structured-output grammars mask disallowed tokens first, so everything after (logprobs included)
sees the constrained distribution; logprobs are taken from those logits; penalties, logit_bias and banned tokens
(bad_words, min_tokens) are applied next, then forced tokens (a spent thinking budget; logits_processors.py);
greedy rows take the argmax there, so they stay exact next to sampled rows; sampled rows are divided by their
temperature, then min_p, top_k and top_p mask.
Sampled rows draw with the exponential-race trick (argmax of p / q, q ~ Exp(1)), which needs no sort; a seeded row
draws its q from its own generator (seeded per output position, see worker/sampling_inputs.py), so its tokens do not
depend on the rest of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.model_executor.layers.logits_processors import (
    apply_bias_and_bans,
    apply_penalties,
    force_tokens,
    mask_disallowed,
)


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
    min_p: torch.Tensor | None = None  # [B] float32, when any row has min_p > 0
    # Penalties, when any row has one: padded token ids (pad = vocab size) and per-row values.
    prompt_tokens: torch.Tensor | None = None
    output_tokens: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, values)
    bans: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) masked to -inf
    num_logprobs: list[int | None] = field(default_factory=list)  # per row; None: no logprobs
    # Structured outputs: (rows, or None for all; [len(rows), V] bool) the tokens each constrained row may not
    # sample.
    disallowed_tokens: tuple[torch.Tensor | None, torch.Tensor] | None = None
    forced_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) each row must take


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    # Per row, for rows that asked: (token ids, logprobs, ranks) with the sampled token first, then the top-k.
    logprobs: list[tuple[list[int], list[float], list[int]] | None] | None = None


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
                    ) -> list[tuple[list[int], list[float], list[int]] | None]:
    """logprobs [N, V] (log_softmax), token_ids [N]: each row's token with its rank (1 + the number of strictly
    more likely tokens) followed by its top-k tokens (ranks 1..k)."""
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = ((logprobs > token_lp).sum(dim=-1) + 1).tolist()
    k = max((n for n in num_logprobs if n is not None), default=0)
    ids, values = token_ids.unsqueeze(1), token_lp
    if k > 0:
        top_values, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        ids, values = torch.cat([ids, top_ids], dim=1), torch.cat([values, top_values], dim=1)
    ids, values = ids.tolist(), values.tolist()
    result = []
    for row, n in enumerate(num_logprobs):
        if n is None:
            result.append(None)
            continue
        result.append((ids[row][:1 + n], values[row][:1 + n], [ranks[row]] + list(range(1, n + 1))))
    return result


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


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
        # Rows with top_p 1 keep everything (float rounding can push the cumulative mass past 1).
        outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        outside[:, 0] = False
        last_kept = sorted_logits.masked_fill(outside, float("inf")).min(dim=-1, keepdim=True).values
        threshold = torch.maximum(threshold, last_kept)
    return logits.masked_fill(logits < threshold, float("-inf"))


class Sampler:
    def __call__(self, logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
        """logits: [B, V] float32 raw model logits."""
        if tensors.disallowed_tokens is not None:
            logits = mask_disallowed(logits, *tensors.disallowed_tokens)
        masked = logits  # the processors below return new tensors
        wants_logprobs = any(n is not None for n in tensors.num_logprobs)
        raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None
        if tensors.repetition_penalty is not None:
            logits = apply_penalties(logits, tensors.prompt_tokens, tensors.output_tokens,
                                     tensors.repetition_penalty, tensors.frequency_penalty,
                                     tensors.presence_penalty)
        if tensors.logit_bias is not None or tensors.bans is not None:
            logits = apply_bias_and_bans(logits, tensors.logit_bias, tensors.bans)
        if tensors.forced_tokens is not None:
            logits = force_tokens(logits, *tensors.forced_tokens)
        tokens = self._sample(logits, tensors)
        if tensors.disallowed_tokens is not None:
            tokens = self._keep_to_grammar(tokens, masked, *tensors.disallowed_tokens)
        logprobs = gather_logprobs(raw_logprobs, tokens, tensors.num_logprobs) if wants_logprobs else None
        return SamplerOutput(tokens, logprobs)

    @staticmethod
    def _keep_to_grammar(tokens: torch.Tensor, masked: torch.Tensor, rows: torch.Tensor | None,
                         disallowed: torch.Tensor) -> torch.Tensor:
        """A constrained row whose other parameters left no allowed token with a finite logit (a penalty that
        overflows, bans or min_tokens on every allowed token) samples NaN or a banned token: such a row takes its
        most likely allowed token instead, so the output never leaves its grammar. Computed for every row, without
        asking first whether any needs it: that question would wait for the device."""
        chosen = tokens if rows is None else tokens[rows]
        bad = disallowed.gather(1, chosen.unsqueeze(1)).squeeze(1)
        fallback = (masked if rows is None else masked[rows]).argmax(dim=-1)
        chosen = torch.where(bad, fallback, chosen)
        if rows is None:
            return chosen
        return tokens.index_put((rows,), chosen)

    def _sample(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        if tensors.all_greedy:
            return greedy_tokens
        greedy = tensors.temperature == 0
        logits = logits / torch.where(greedy, 1.0, tensors.temperature).unsqueeze(1)
        if tensors.min_p is not None:
            logits = apply_min_p(logits, tensors.min_p)
        if tensors.needs_top_k or tensors.needs_top_p:
            logits = apply_top_k_top_p(logits, tensors.top_k if tensors.needs_top_k else None,
                                       tensors.top_p if tensors.needs_top_p else None)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for row, generator in tensors.generators.items():
            q[row].exponential_(generator=generator)
        sampled = probs.div_(q).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)
