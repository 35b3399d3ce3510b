"""Pooling: a pooling request's vector from the final-norm hidden states of its prompt (vLLM's Pooler), in float32.

A prompt may be computed over several steps (chunked prefill), so the worker pools each chunk on its own and
returns the chunk's *contribution*; the scheduler adds the contributions up (core/sched/results.py), which needs no
state in the worker and survives preemption by swapping (a recompute starts the sum again):

    LAST   the last prompt position's hidden state, from the chunk that ends the prompt
    MEAN   the chunk's hidden states summed, divided by the prompt length (the sum over chunks is the mean)
    CLS    the first position's hidden state, from the chunk that starts the prompt
    classify (a task, not a type): the logits of `returned_token_ids` at the last position

MEAN and CLS need hidden states of every (or the first) position, so those requests never read the prefix cache
(`PoolingParams.skip_reading_prefix_cache`); LAST may, since the last position is always computed.

`finish_pooled` turns the summed vector into what the user gets: Matryoshka truncation to `dimensions`, then L2
normalisation (embeddings only).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.pooling_params import PoolingParams

NORM_EPS = 1e-12  # torch.nn.functional.normalize's


@dataclass(frozen=True, slots=True)
class PoolingChunk:
    """One pooling request's part of a step."""

    request_id: str
    start: int  # flat index of the chunk's first token among the step's hidden states
    num_tokens: int
    position: int  # the prompt position of its first token
    prompt_len: int
    params: PoolingParams

    @property
    def ends_prompt(self) -> bool:
        return self.position + self.num_tokens == self.prompt_len


def pool_chunks(hidden: torch.Tensor, chunks: list[PoolingChunk],
                compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, np.ndarray]:
    """Each chunk's contribution to its request's pooled vector (float32 on the host); chunks that contribute
    nothing (not the last chunk under LAST, not the first under CLS) are left out. All the rows reach the host in
    one copy, and the classify rows' logits come from one `compute_logits` call (a collective under tensor
    parallelism: every rank makes it)."""
    rows: dict[str, torch.Tensor] = {}
    classify = [c for c in chunks if c.params.task == "classify" and c.ends_prompt]
    for chunk in chunks:
        kind = chunk.params.pooling_type if chunk.params.task == "embed" else None
        if kind == "LAST" and chunk.ends_prompt:
            rows[chunk.request_id] = hidden[chunk.start + chunk.num_tokens - 1].float()
        elif kind == "CLS" and chunk.position == 0:
            rows[chunk.request_id] = hidden[chunk.start].float()
        elif kind == "MEAN":
            part = hidden[chunk.start:chunk.start + chunk.num_tokens].float().sum(dim=0)
            rows[chunk.request_id] = part / chunk.prompt_len
    if classify:
        last = torch.tensor([c.start + c.num_tokens - 1 for c in classify], device=hidden.device)
        logits = compute_logits(hidden[last]).float()
        for i, chunk in enumerate(classify):
            ids = torch.tensor(chunk.params.returned_token_ids, device=logits.device)
            rows[chunk.request_id] = logits[i, ids]
    if not rows:
        return {}
    # One device-to-host copy for the step: rows of equal length are stacked.
    by_length: dict[int, list[str]] = {}
    for request_id, row in rows.items():
        by_length.setdefault(row.shape[0], []).append(request_id)
    result = {}
    for request_ids in by_length.values():
        host = torch.stack([rows[r] for r in request_ids]).cpu().numpy()
        result.update(zip(request_ids, host))
    return result


def finish_pooled(data: np.ndarray, params: PoolingParams) -> np.ndarray:
    """The user's vector from the summed contributions: an embedding truncated to `dimensions` (Matryoshka) and
    then L2-normalised when `normalize`; classify logits as they are. Always float32."""
    data = np.asarray(data, dtype=np.float32)
    if params.task != "embed":
        return data
    if params.dimensions is not None:
        data = data[:params.dimensions]
    if params.normalize:
        data = data / max(float(np.linalg.norm(data)), NORM_EPS)
    return data.astype(np.float32, copy=False)
