"""The sampler's inputs for a batch: each row's sampling parameters, seeded generator, grammar bitmask, penalties,
logit bias and bans turned into the tensors of a `SamplingTensors` (copied to the device without synchronizing)."""
from __future__ import annotations

import torch

from pagellm.model_executor.host_copy import tensor_on, to_device
from pagellm.model_executor.layers.logits_processors import (
    bad_words_bans,
    pad_token_lists,
    thinking_budget_token,
    unpack_disallowed,
)
from pagellm.model_executor.layers.sampler import SamplingTensors
from pagellm.worker.input_batch import BatchedRequest


def row_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's draw for its output token `index` (splitmix64 of the pair): each token's noise
    depends on nothing but the request's seed and the token's place in its output."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def build_sampling_tensors(requests: list[BatchedRequest], vocab: int, device: torch.device,
                           last_inputs: torch.Tensor | None = None) -> SamplingTensors:
    """The sampler's tensors for one logits row per entry of `requests` (a request's rows in a row: its samples
    at the same position for n > 1, or its verified positions with speculative decoding). A seeded row draws from a
    generator seeded by the request's seed and the index of the output token it samples (`row_seed`), so a seeded
    request's tokens depend neither on the batch, nor on retries, nor on how many drafts a step verified: with
    speculation it gets the tokens it gets without.

    Async scheduling: a request with a pending token (see worker/input_batch.py) has generated one token more than
    its `output_token_ids` hold; `last_inputs` (each row's last input token, on the device) supplies it to the
    penalties, and min_tokens counts it."""
    params = [r.sampling_params for r in requests]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    row_generators = {}
    rows_before: dict[str, int] = {}  # the request's rows already seen in this batch
    offsets = []  # each row's place among its request's rows
    for row, (request, p) in enumerate(zip(requests, params)):
        offset = rows_before.get(request.request_id, 0)
        rows_before[request.request_id] = offset + 1
        offsets.append(offset)
        if p.seed is not None and not p.is_greedy:
            index = len(request.output_token_ids) + request.pending_token + offset
            row_generators[row] = torch.Generator(device).manual_seed(row_seed(p.seed, index))
    tensors = SamplingTensors(
        temperature=tensor_on([0.0 if p.is_greedy else p.temperature for p in params], torch.float32, device),
        top_p=tensor_on([p.top_p for p in params], torch.float32, device),
        top_k=tensor_on(top_k, torch.int64, device),
        all_greedy=all(p.is_greedy for p in params),
        needs_top_k=any(k < vocab for k in top_k),
        needs_top_p=any(p.top_p < 1.0 for p in params),
        generators=row_generators,
        num_logprobs=[p.logprobs for p in params],
    )
    constrained = [row for row, r in enumerate(requests) if r.grammar_bitmask is not None]
    if constrained:
        # A verify step's rows follow its positions; n > 1 samples share their one position's row.
        masks = [requests[row].grammar_bitmask[offsets[row] % (requests[row].num_spec_tokens + 1)]
                 for row in constrained]
        disallowed = unpack_disallowed(masks, vocab)
        rows = None if len(constrained) == len(requests) else tensor_on(constrained, torch.int64, device)
        tensors.disallowed_tokens = (rows, to_device(disallowed, device))
    if any(p.min_p > 0.0 and not p.is_greedy for p in params):
        tensors.min_p = tensor_on([p.min_p for p in params], torch.float32, device)
    if any(p.needs_penalties for p in params):
        # Token lists only for the rows with a penalty; the others get padding (no effect).
        penalized = [p.needs_penalties for p in params]
        tensors.prompt_tokens = pad_token_lists(
            [r.prompt_token_ids if on else () for r, on in zip(requests, penalized)], vocab, device)
        tensors.output_tokens = pad_token_lists(
            [r.output_token_ids if on else () for r, on in zip(requests, penalized)], vocab, device)
        pending = [row for row, (r, on) in enumerate(zip(requests, penalized)) if on and r.pending_token]
        if pending:
            # One more column: the pending token where a penalized row has one, padding (no effect) elsewhere.
            column = torch.full((len(requests),), vocab, dtype=torch.int64, device=device)
            rows = tensor_on(pending, torch.int64, device)
            column[rows] = last_inputs[rows]
            tensors.output_tokens = torch.cat([tensors.output_tokens, column[:, None]], dim=1)
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            setattr(tensors, name, tensor_on([getattr(p, name) for p in params], torch.float32, device))
    bias_rows, bias_ids, bias_values, ban_rows, ban_ids = [], [], [], [], []
    for row, (request, p) in enumerate(zip(requests, params)):
        if p.logit_bias:
            bias_rows += [row] * len(p.logit_bias)
            bias_ids += list(p.logit_bias)
            bias_values += list(p.logit_bias.values())
        banned = []
        if request.bad_words_token_ids:
            banned += bad_words_bans(request.bad_words_token_ids, request.output_token_ids)
        if len(request.output_token_ids) + request.pending_token < p.min_tokens:
            banned += p.stop_token_ids
            if not p.ignore_eos:
                banned += request.eos_token_ids
        ban_rows += [row] * len(banned)
        ban_ids += banned
    if bias_rows:
        tensors.logit_bias = (tensor_on(bias_rows, torch.int64, device), tensor_on(bias_ids, torch.int64, device),
                              tensor_on(bias_values, torch.float32, device))
    if ban_rows:
        tensors.bans = (tensor_on(ban_rows, torch.int64, device), tensor_on(ban_ids, torch.int64, device))
    forced = [(row, token) for row, token in enumerate(_thinking_budget_tokens(requests)) if token is not None]
    if forced:
        tensors.forced_tokens = (tensor_on([row for row, _ in forced], torch.int64, device),
                                 tensor_on([token for _, token in forced], torch.int64, device))
    return tensors


def _thinking_budget_tokens(requests: list[BatchedRequest]) -> list[int | None]:
    """Per row, the end-of-reasoning token its spent thinking budget forces (see thinking_budget_token). Such a
    request never samples blind (core/sched/async_scheduling.py), so its output tokens here are all of them."""
    tokens: list[int | None] = []
    for request in requests:
        p = request.sampling_params
        if p.thinking_token_budget is None or p.reasoning_token_ids is None:
            tokens.append(None)
            continue
        tokens.append(thinking_budget_token(request.prompt_token_ids, request.output_token_ids,
                                            p.reasoning_token_ids.start, p.reasoning_token_ids.end,
                                            p.thinking_token_budget))
    return tokens
