"""The engine's view of one sequence: its tokens, progress and status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagellm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
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
    # With sampling_params.prompt_logprobs: one entry per prompt token after the first, same form.
    prompt_logprobs: list[tuple[list[int], list[float], list[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

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
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
