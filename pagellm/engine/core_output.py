"""What the engine core reports after each step: per sequence, only what is new, as plain values.

The output side (detokenization, stop strings, RequestOutputs) works from these snapshots and never reads the
core's live Request objects, so it can run in another thread than the core (see AsyncLLM).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagellm.beam_search import BeamSearchOutput
from pagellm.metrics.stats import SchedulerStats
from pagellm.outputs import LogprobsEntry


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str  # the sequence's id in the core
    group_id: str  # the user's request id
    index: int  # which of the request's n sequences
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None  # with sampling_params.logprobs
    # With sampling_params.prompt_logprobs: every prompt token's entry after the first, sent once.
    prompt_logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None  # "stop", "length"; None while running
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS)
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # A pooling request, once finished: its pooled vector (float32; not yet truncated or normalised).
    pooled_data: np.ndarray | None = None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # Beam searches that finished this step: user request id -> result (text not yet decoded).
    finished_beam_searches: dict[str, BeamSearchOutput] = field(default_factory=dict)
    # Requests that failed inside the engine this step: user request id -> why (each sequence finished, blocks
    # freed; the rest of the batch went on).
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class CoreUpdate:
    """What an engine core publishes after each pass of its loop (see EngineCoreLoop); plain data, so it can
    cross a process boundary."""

    outputs: EngineCoreOutputs
    refused: dict[str, BaseException]  # requests not queued (e.g. a full waiting queue): request id -> why
    left: list[str]  # requests no longer in the core (finished, failed or aborted there)
    stats: SchedulerStats
