"""What the scheduler hands to the workers each step: a self-contained description of the batch."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    num_computed_tokens: int  # position of token_ids[0]
    block_ids: list[int]  # the request's whole block table
    sampling_params: SamplingParams
    needs_sample: bool  # False for a prefill chunk that does not reach the end of the known tokens
    # References to the request's lists (not copies), read by the sampler for penalties, bad words, min_tokens
    # and prompt logprobs. They are current when the step runs: the scheduler appends only after it.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    num_samples: int = 1  # n > 1: the first sample draws n tokens from the same logits (one per sequence)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests finished since the last step: workers drop their per-request state (e.g. seeded generators).
    finished_req_ids: list[str] = field(default_factory=list)
    # Block moves the workers make before the forward pass, in this order: (device block, host block) pairs to
    # copy out to the host tier, (host block, device block) pairs to copy back in, then (source, destination)
    # device blocks to copy (copy-on-write of shared blocks). Swaps come first because a device block evicted
    # this step may be handed to a request that the same step writes or swaps into.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
