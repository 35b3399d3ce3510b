"""The engine's view of one sequence: its tokens, progress and status."""
from __future__ import annotations

import copy
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from pagellm.core.beam_group import BeamGroup


class RequestStatus(enum.IntEnum):
    WAITING_FOR_FSM = enum.auto()  # its structured-output grammar is still compiling (vLLM's name)
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed inside the engine; the rest of the batch went on

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence. `num_computed_tokens` counts tokens whose K/V are in the cache; the scheduler's only
    job is to move it towards `num_tokens` (prompt + generated so far)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # empty when the model has none
    max_tokens: int
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # with --scheduling-policy priority: lower runs first, ties by arrival (vLLM's convention)
    cache_salt: str | None = None  # mixed into the first block's hash: different salts share no cached blocks
    lora_request: LoRARequest | None = None  # the adapter it runs with; its id is in the first block's hash too
    first_scheduled_time: float | None = None
    # The user's request id, and which of its sequences this is: with n > 1 the first sample forks the request
    # into n sequences (`{group_id}/{index}` for index > 0) that share the prompt's KV blocks.
    group_id: str = ""
    index: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # sampling_params.bad_words, tokenized
    all_token_ids: list[int] = field(init=False)
    # With sampling_params.logprobs: per output token, (token ids, logprobs, ranks) with the sampled token first.
    logprobs: list[tuple[list[int], list[float], list[int]]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Output tokens the last step appended: 1, or more when speculative decoding accepted draft tokens.
    num_step_tokens: int = 1
    # With sampling_params.prompt_logprobs: one entry per prompt token after the first, same form.
    prompt_logprobs: list[tuple[list[int], list[float], list[int]]] = field(default_factory=list)

    # Beam search: the group this beam belongs to, and the (token ids, logprobs) of its best next tokens once
    # sampled; the beam then waits (nothing to compute) until the group picks the next beams.
    beam_group: BeamGroup | None = None
    beam_candidates: tuple[list[int], list[float]] | None = None

    # sampling_params.structured_outputs: the sequence's grammar (compiling while status is WAITING_FOR_FSM).
    structured_output_request: StructuredOutputRequest | None = None

    # Prefix caching: the chained hash of each full block of all_token_ids (extended by the KV cache manager as
    # tokens arrive), and how many prompt tokens the first admission found in the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0

    # A pooling request (embeddings, scores) runs its prompt only and finishes with a vector instead of a token;
    # its `sampling_params` are then a placeholder that samples nothing. `pooled_data` is the sum of the pooled
    # contributions of the chunks computed so far (see model_executor/layers/pooler.py).
    pooling_params: PoolingParams | None = None
    pooled_data: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        if self.sampling_params.structured_outputs is not None and self.structured_output_request is None:
            self.structured_output_request = StructuredOutputRequest(self.sampling_params.structured_outputs)
            self.status = RequestStatus.WAITING_FOR_FSM

    def fork(self, request_id: str, index: int, sampling_params: SamplingParams | None = None) -> Request:
        """A new sequence with this one's tokens and progress (its KV blocks are shared by the caller)."""
        child = copy.copy(self)
        child.request_id = request_id
        child.index = index
        if sampling_params is not None:
            child.sampling_params = sampling_params
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.logprobs = list(self.logprobs)
        child.block_hashes = list(self.block_hashes)
        child.prompt_logprobs = []  # reported once, by the group's first sequence
        child.beam_candidates = None
        if self.structured_output_request is not None:
            child.structured_output_request = self.structured_output_request.fork()
        child.num_preemptions = 0  # its own, from now on
        return child

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Cached positions are never computed, so a request that needs something from each prompt position (prompt
        logprobs; mean or CLS pooling) computes them all (vLLM's name)."""
        pooling = self.pooling_params
        return self.sampling_params.prompt_logprobs is not None or (pooling is not None
                                                                    and pooling.skip_reading_prefix_cache)

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
