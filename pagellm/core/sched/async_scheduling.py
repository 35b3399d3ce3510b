"""Async scheduling (`--async-scheduling`): the engine schedules and submits batch N+1 while batch N still runs, so
the accelerator never waits for the CPU to apply N's results and prepare N+1 (MISSION.md section 3; vLLM's
`--async-scheduling`).

A request in batch N may go into N+1 when what it computes next does not depend on N's results. The next chunk of a
prompt never does. A decode does only through the token N samples: N+1 computes it blind (the worker takes it from
N's sampled tokens on the device), unless the host must see the token first. It must for beams (the group picks
the next tokens), the first sample of an n > 1 request (it forks) and bad words (whether a bad word's prefix ends
the output is decided on the host), and a thinking budget (whether reasoning is open is read from the tokens).
Such a request waits for N, and the engine then collects N before scheduling
(no batch leaves it behind). Penalties and min_tokens do not make a request wait: the worker counts the token in
flight itself (see worker/sampling_inputs.py). Nor do grammars: N+1's forward pass runs blind, and its sampling
waits for the bitmask, computed once N's tokens have advanced the grammars (see engine/core.py). If N's token ends
the request (EOS, a stop token or string, a complete grammar), N+1's work for it is dropped: one token's compute,
where a synchronous step would have waited for the CPU.

Speculative decoding: a blind decode assumes that N emits exactly one token for the request, but a step that verifies
a draft emits 1 to k + 1 (the placeholders of method draft_model too), so a request whose part of N verifies a draft
waits for N. So does one that the drafter would speculate on next (`AdaptiveDrafter.may_draft`): a draft is made from
the request's tokens, the one in flight included, so it cannot be made blind. A request whose drafting is off (text
that does not repeat) keeps running blind: on such text speculation switches off and the overlap stays. Drafting
requests thus run as with synchronous scheduling, the engine collecting before it schedules them.
"""
from __future__ import annotations

from pagellm.core.request import Request
from pagellm.core.sched.output import ScheduledRequest


def may_sample_blind(request: Request, flight: ScheduledRequest, drafts_next: bool = False) -> bool:
    """Whether the request's next step may run before the token its batch in flight samples is known here.
    `drafts_next`: the drafter would speculate on it next (speculative decoding)."""
    return (flight.num_samples == 1 and not flight.spec_token_ids and not drafts_next and request.beam_group is None
            and not request.bad_words_token_ids and request.sampling_params.thinking_token_budget is None)


def tokens_after_flight(request: Request, flight: ScheduledRequest, max_model_len: int,
                        drafts_next: bool = False) -> int | None:
    """Tokens the request could compute in the next batch while `flight`, its part of a batch still running, is out
    (before the token budget): 0 when it has none (the token in flight is its last by length), None when it must
    wait for that batch's results. `drafts_next`: the drafter would speculate on it next."""
    computed = flight.num_computed_tokens + flight.num_tokens
    if not flight.needs_sample:
        return request.num_tokens - computed  # the prompt's next chunk
    if request.num_output_tokens + 1 >= request.max_tokens or request.num_tokens + 1 >= max_model_len:
        return 0
    if not may_sample_blind(request, flight, drafts_next):
        return None
    return request.num_tokens + 1 - computed  # the sampled token, computed blind
