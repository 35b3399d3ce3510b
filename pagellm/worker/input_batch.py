"""The worker's persistent view of the sequences it runs, kept in step with the scheduler from the diffs in each
SchedulerOutput (see core/sched/output.py), and the per-step batch built from it.

The worker owns these lists: nothing aliases the scheduler's state, so the same code serves a worker in another
process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagellm.core.sched.output import NewRequestData, SchedulerOutput
from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    bad_words_token_ids: list[list[int]]
    all_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    group_block_ids: list[list[int]] = field(default_factory=list)  # the other KV cache groups' tables

    @classmethod
    def from_new(cls, data: NewRequestData) -> CachedRequestState:
        return cls(data.request_id, list(data.prompt_token_ids), list(data.output_token_ids), data.sampling_params,
                   data.eos_token_ids, data.bad_words_token_ids,
                   all_token_ids=data.prompt_token_ids + data.output_token_ids, pooling_params=data.pooling_params,
                   lora_request=data.lora_request)


@dataclass(slots=True, eq=False)
class BatchedRequest:
    """One sequence's part of this step, as the model runner consumes it."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    num_computed_tokens: int  # position of token_ids[0]
    block_ids: list[int]  # the sequence's whole block table (the first KV cache group's)
    sampling_params: SamplingParams
    needs_sample: bool
    # The worker's own lists, read by the sampler for penalties, bad words, min_tokens and prompt logprobs.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    num_samples: int = 1
    # Async scheduling: token_ids[-1] is a placeholder for the token the previous batch sampled (see ModelRunner).
    pending_token: bool = False
    # Structured outputs: this step's packed rows of the tokens the sequence may sample, one per sampled position
    # (1 + num_spec_tokens; see GrammarOutput in core/sched/output.py), attached once the bitmask has come.
    grammar_bitmask: np.ndarray | None = None
    pooling_params: PoolingParams | None = None  # a pooling request: this chunk is pooled (see layers/pooler.py)
    lora_request: LoRARequest | None = None  # the adapter its rows run with (see lora/context.py)
    # Speculative decoding: the last `num_spec_tokens` of token_ids are draft tokens; all 1 + num_spec_tokens
    # last positions are sampled (verified as spec_decode/verify.py says).
    num_spec_tokens: int = 0
    # Models with several KV cache groups: the other groups' whole tables, as long as `block_ids`.
    group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_tables(self) -> list[list[int]]:
        """Every KV cache group's whole table, in group order (one for a model with one group)."""
        return [self.block_ids, *self.group_block_ids]


class InputBatch:
    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, output: SchedulerOutput) -> list[BatchedRequest]:
        """Apply the step's diffs; returns its batch in the scheduler's order."""
        for request_id in (*output.finished_req_ids, *output.preempted_req_ids):
            self.requests.pop(request_id, None)
        for data in output.new_requests:
            self.requests[data.request_id] = CachedRequestState.from_new(data)
        batch = []
        for scheduled in output.scheduled:
            state = self.requests.get(scheduled.request_id)
            if state is None:
                raise RuntimeError(f"The worker has no state for request {scheduled.request_id}: the scheduler "
                                   f"must send a sequence in full before it sends its changes.")
            if scheduled.new_token_ids:
                state.output_token_ids += scheduled.new_token_ids
                state.all_token_ids += scheduled.new_token_ids
            if scheduled.replaces_block_table:
                state.block_ids = list(scheduled.new_block_ids)
                state.group_block_ids = [list(ids) for ids in scheduled.new_group_block_ids]
            else:
                state.block_ids += scheduled.new_block_ids
                for table, ids in zip(state.group_block_ids, scheduled.new_group_block_ids, strict=True):
                    table += ids
            num_spec = len(scheduled.spec_token_ids)
            start = scheduled.num_computed_tokens
            end = start + scheduled.num_tokens - num_spec
            token_ids = state.all_token_ids[start:end] + scheduled.spec_token_ids
            if len(token_ids) != scheduled.num_tokens - scheduled.pending_token:
                raise RuntimeError(f"Request {state.request_id}: the worker has {len(state.all_token_ids)} tokens, "
                                   f"the step computes up to {end} (pending token: {scheduled.pending_token}).")
            if scheduled.pending_token:
                token_ids.append(0)
            batch.append(BatchedRequest(
                state.request_id, token_ids, start, state.block_ids, state.sampling_params, scheduled.needs_sample,
                state.prompt_token_ids, state.output_token_ids, state.eos_token_ids, state.bad_words_token_ids,
                scheduled.num_samples, scheduled.pending_token, pooling_params=state.pooling_params,
                lora_request=state.lora_request, num_spec_tokens=num_spec, group_block_ids=state.group_block_ids))
        return batch


def attach_grammar_bitmask(requests: list[BatchedRequest], request_ids: list[str], bitmask: np.ndarray) -> None:
    """Give each constrained request its bitmask rows: `request_ids` in order, each taking 1 + its draft tokens
    rows of `bitmask` (row i: the tokens allowed at its i-th sampled position, see StructuredOutputManager); an
    n > 1 request, listed once, samples each of its samples under its one row."""
    num_rows = {r.request_id: 1 + r.num_spec_tokens for r in requests}
    rows: dict[str, np.ndarray] = {}
    start = 0
    for request_id in request_ids:
        end = start + num_rows.get(request_id, 1)
        rows[request_id], start = bitmask[start:end], end
    if start != len(bitmask):
        raise RuntimeError(f"The grammar bitmask has {len(bitmask)} rows for the step's {start} constrained "
                           f"positions.")
    for request in requests:
        request.grammar_bitmask = rows.get(request.request_id)
