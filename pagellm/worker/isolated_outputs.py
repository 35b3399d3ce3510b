"""A step's per-request results from the model's hidden states and logits, each request's failure kept to itself:
sampled tokens and their logprobs (`BatchSampler`), prompt logprobs (`compute_prompt_logprobs`) and pooled vectors
(`pool`).

A request whose own part raises goes into `failed` (which becomes `ModelRunnerOutput.failed`) and the rest of the
batch keeps its results: when a batched sampling or pooling call raises, each request's part is computed alone to
find the one that breaks it (greedy and seeded requests get exactly the tokens the batch would have given them: a
seeded row's noise depends only on its seed and output position, see worker/sampling_inputs.py).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagellm.logger import init_logger
from pagellm.model_executor.host_copy import tensor_on
from pagellm.model_executor.layers.pooler import PoolingChunk, pool_chunks
from pagellm.model_executor.layers.sampler import Sampler, SamplingTensors, gather_logprobs
from pagellm.outputs import LogprobsEntry
from pagellm.worker.input_batch import BatchedRequest
from pagellm.worker.sampling_inputs import build_sampling_tensors

logger = init_logger(__name__)

# Rows sampled (ascending), their tokens (on the device) and logprobs entries (None where not asked for).
SampledRows = tuple[list[int], torch.Tensor, list[LogprobsEntry | None]]


def _record_failure(failed: dict[str, str], request_id: str, what: str, exc: Exception) -> None:
    logger.error("%s of request %s failed; the request fails alone.", what, request_id, exc_info=exc)
    failed[request_id] = f"{type(exc).__name__}: {exc}"


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            chunks: list[tuple[BatchedRequest, int]], device: torch.device,
                            failed: dict[str, str]) -> dict[str, tuple[int, list]]:
    """Logprobs of each prompt token (after the first) from the previous position's raw logits, for the positions
    of this step's chunk of each (request, flat index of its first token) only; later chunks continue where this
    one ends. A request whose computation raises goes into `failed`."""
    result = {}
    for request, flat_start in chunks:
        try:
            prompt = request.prompt_token_ids
            start = request.num_computed_tokens
            end = min(start + request.num_tokens, len(prompt) - 1)
            logits = compute_logits(hidden[flat_start:flat_start + end - start])
            targets = tensor_on(prompt[start + 1:end + 1], torch.int64, device)
            num = request.sampling_params.prompt_logprobs
            result[request.request_id] = (start, gather_logprobs(logits.log_softmax(dim=-1), targets,
                                                                 [num] * (end - start)))
        except Exception as exc:
            _record_failure(failed, request.request_id, "Prompt logprobs", exc)
    return result


def pool(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, chunks: list[PoolingChunk],
         failed: dict[str, str]) -> dict[str, np.ndarray]:
    """The pooled contribution of each pooling chunk of the step (see layers/pooler.py). If pooling the batch
    raises, each request is pooled alone, so that only the one that breaks it fails."""
    try:
        return pool_chunks(hidden, chunks, compute_logits)
    except Exception as exc:
        if len(chunks) == 1:
            _record_failure(failed, chunks[0].request_id, "Pooling", exc)
            return {}
    pooled = {}
    for chunk in chunks:
        try:
            pooled.update(pool_chunks(hidden, [chunk], compute_logits))
        except Exception as exc:
            _record_failure(failed, chunk.request_id, "Pooling", exc)
    return pooled


class BatchSampler:
    """The `Sampler` over a step's logits rows, its inputs built from the rows' requests."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()

    def sampling_tensors(self, requests: list[BatchedRequest],
                         last_inputs: torch.Tensor | None = None) -> SamplingTensors:
        return build_sampling_tensors(requests, self.vocab_size, self.device, last_inputs)

    def sample(self, logits: torch.Tensor, requests: list[BatchedRequest], failed: dict[str, str],
               last_inputs: torch.Tensor | None = None) -> SampledRows:
        """Sample every logits row (one per entry of `requests`) of requests not in `failed`, in one batch; if
        that raises, sample each request's rows alone so that only the request that breaks sampling fails (it
        goes into `failed`). `last_inputs`: each row's last input token on the device (async scheduling)."""
        by_request: dict[str, list[int]] = {}
        for row, request in enumerate(requests):
            if request.request_id not in failed:
                by_request.setdefault(request.request_id, []).append(row)
        rows = [row for request_rows in by_request.values() for row in request_rows]
        if not rows:
            return [], torch.empty(0, dtype=torch.int64, device=logits.device), []
        try:
            return self.sample_rows(logits, requests, rows, last_inputs)
        except Exception as exc:
            if len(by_request) == 1:
                _record_failure(failed, next(iter(by_request)), "Sampling", exc)
                return [], torch.empty(0, dtype=torch.int64, device=logits.device), []
        parts = []
        for request_id, request_rows in by_request.items():
            try:
                parts.append(self.sample_rows(logits, requests, request_rows, last_inputs))
            except Exception as exc:
                _record_failure(failed, request_id, "Sampling", exc)
        if not parts:
            return [], torch.empty(0, dtype=torch.int64, device=logits.device), []
        return ([row for part in parts for row in part[0]], torch.cat([part[1] for part in parts]),
                [entry for part in parts for entry in part[2]])

    def sample_rows(self, logits: torch.Tensor, requests: list[BatchedRequest], rows: list[int],
                    last_inputs: torch.Tensor | None = None) -> SampledRows:
        """Sample the logits rows `rows` in one batch."""
        every_row = len(rows) == len(requests)
        subset = logits if every_row else logits[rows]
        if last_inputs is not None and not every_row:
            last_inputs = last_inputs[rows]
        out = self.sampler(subset, self.sampling_tensors([requests[row] for row in rows], last_inputs))
        return rows, out.sampled, out.logprobs or [None] * len(rows)
