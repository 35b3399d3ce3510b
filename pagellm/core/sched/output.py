"""What the scheduler hands to the workers each step: plain data, self-contained, and only what changed.

A sequence is sent in full (`NewRequestData`) the first time the workers see it: when it is admitted, forked
(n > 1, beam search) or resumed after preemption. After that each step carries, per scheduled sequence, only the
tokens and KV blocks added since the workers last saw it. Workers keep the rest (see worker/input_batch.py) and
drop a sequence when it finishes or is preempted. Nothing here aliases scheduler state, so the whole object can be
pickled to another process.

The token bitmask of a step's constrained sequences travels apart, as a `GrammarOutput`: the engine computes it while
the workers run the forward pass, and the rank that samples waits for it only then (see engine/core.py).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (a fork or a preempted sequence has some)
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    pooling_params: PoolingParams | None = None  # a pooling request: its prompt is pooled, nothing is sampled
    lora_request: LoRARequest | None = None  # the adapter it runs with


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    num_tokens: int  # tokens to compute this step, from position num_computed_tokens on
    num_computed_tokens: int
    # Generated tokens appended since the workers last saw the sequence (all of them for a new one: none).
    new_token_ids: list[int] = field(default_factory=list)
    # KV blocks appended to its table since then; the whole table when `replaces_block_table` (new sequences,
    # and tables whose blocks changed in place: copy-on-write).
    new_block_ids: list[int] = field(default_factory=list)
    replaces_block_table: bool = False
    # False for a prefill chunk that does not reach the end of the known tokens, and for pooling requests.
    needs_sample: bool = True
    num_samples: int = 1  # n > 1: the first sample draws n tokens from the same logits (one per sequence)
    # Async scheduling: the last token to compute is the one the previous batch samples, unknown here when this
    # batch was scheduled; the worker takes it from that batch's sampled tokens.
    pending_token: bool = False
    # Speculative decoding: draft tokens computed after the known ones (the last `len` of `num_tokens`); the
    # worker samples every one of the 1 + len positions, and the scheduler keeps the tokens up to the first
    # mismatch (see spec_decode/).
    spec_token_ids: list[int] = field(default_factory=list)
    # Models with several KV cache groups (core/kv/kv_cache_groups.py): the other groups' blocks, one list per group
    # after the first, appended (or replacing) as `new_block_ids` are.
    new_group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    # Sequences the workers drop: preempted this step, and finished since the last step.
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    # Block moves the workers make before the forward pass, in this order: (device block, host block) pairs to
    # copy out to the host tier, (host block, device block) pairs to copy back in, then (source, destination)
    # device blocks to copy (copy-on-write of shared blocks). Swaps come first because a device block evicted
    # this step may be handed to a request that the same step writes or swaps into.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: the sequences of this step that sample under a grammar. Their bitmask rows come in the
    # step's GrammarOutput, in this order; the rank that samples waits for it after the forward pass.
    structured_output_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do: no sequence to compute and no block to move."""
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)


@dataclass
class GrammarOutput:
    """The second half of a step with constrained sequences: per `SchedulerOutput.structured_output_request_ids`
    entry (same order) a packed row of the tokens it may sample (int32 words, bit t % 32 of word t // 32; see
    structured_output/), or why the rows could not be computed (the step's constrained sequences then fail alone)."""

    grammar_bitmask: np.ndarray | None = None
    error: str | None = None

    @classmethod
    def from_future(cls, bitmask: Future[np.ndarray]) -> GrammarOutput:
        """Wait for a bitmask being computed on another thread."""
        try:
            return cls(bitmask.result())
        except Exception as exc:
            return cls(error=f"Grammar bitmask: {type(exc).__name__}: {exc}")
