"""Choosing one step's batch: how many tokens each running request computes, which waiting requests are admitted,
and which running requests are preempted to make room.

There are no prefill or decode phases: every request has `num_computed_tokens`, and each step the scheduler
hands out tokens (running requests first, then waiting ones in the policy's order, see policy.py) until the
budget `max_num_batched_tokens` or `max_num_seqs` is reached. A prompt longer than the remaining budget is split
into chunks (when chunked prefill is on), so decodes never stall behind it. A request admitted with a cached
prefix (see KVCacheManager) starts with those tokens computed.

The Scheduler owns the queues (see scheduler.py); these functions move requests between them and preempt through
`Scheduler._preempt`.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagellm.config import SchedulerConfig
from pagellm.core.sched.async_scheduling import tokens_after_flight
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.output import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from pagellm.core.sched.scheduler import Scheduler


def num_sequences(request: Request) -> int:
    """Sequence slots a request takes: n for one that will fork at its first sample, beam_width for the first
    beam of a beam search (the slots of its future sequences are held from admission on, prefill chunks
    included, so forks never take the running count over max_num_seqs), else one."""
    if request.num_output_tokens:
        return 1
    if request.beam_group is not None:
        return request.beam_group.params.beam_width if len(request.beam_group.beams) == 1 else 1
    return request.sampling_params.n


def num_slots_in_use(running: Iterable[Request]) -> int:
    return sum(num_sequences(r) for r in running)


def num_next_tokens(request: Request, flight: ScheduledRequest | None, config: SchedulerConfig) -> int | None:
    """Tokens the request could compute this step, before the token budget; None while it must wait for its
    batch in flight."""
    if flight is None:
        return request.num_tokens - request.num_computed_tokens
    if not config.async_scheduling:
        return None
    return tokens_after_flight(request, flight, config.max_model_len)


def schedule_running(scheduler: Scheduler, output: SchedulerOutput, token_budget: int, limit: int) -> int:
    """Give the running requests their tokens, in order, preempting while the pool is short; returns the token
    budget left."""
    index = 0
    while index < len(scheduler.running) and token_budget > 0 and len(output.scheduled) < limit:
        request = scheduler.running[index]
        flight = scheduler.in_flight.get(request.request_id)
        # None or 0: a request whose last batch has not come back yet, a beam waiting for its siblings.
        num_new = num_next_tokens(request, flight, scheduler.config)
        if not num_new:
            index += 1
            continue
        num_new = min(num_new, token_budget)
        # Slots for the tokens of its batch in flight were allocated when that batch was scheduled.
        allocated = _allocate_or_preempt(scheduler, request, (flight.num_tokens if flight else 0) + num_new, index,
                                         output)
        if request.status != RequestStatus.RUNNING:
            continue  # preempted itself; the request now at `index` is the next one
        if allocated:
            output.scheduled.append(_schedule_request(scheduler, request, num_new, output, flight))
            token_budget -= num_new
        index += 1
    return token_budget


def _allocate_or_preempt(scheduler: Scheduler, request: Request, num_slots: int, index: int,
                         output: SchedulerOutput) -> bool:
    """Allocate `num_slots` slots after the request's computed tokens, preempting running requests from
    `index` on (not yet scheduled this step, nor in flight) while the pool is short. False when it could not:
    the request itself was preempted, or nobody can be."""
    while not scheduler.kv_cache_manager.allocate_slots(request, num_slots):
        candidates = _preemptible(scheduler.running[index:], scheduler.in_flight)
        if not candidates:
            return False
        victim = scheduler.policy.pick_victim(candidates)
        scheduler.running.remove(victim)
        scheduler._preempt(victim)
        output.preempted_req_ids.append(victim.request_id)
        if victim is request:
            return False
    return True


def _preemptible(candidates: list[Request], in_flight: dict[str, ScheduledRequest]) -> list[Request]:
    return [r for r in candidates if r.request_id not in in_flight] if in_flight else candidates


def admit_compiled_grammars(scheduler: Scheduler) -> None:
    """Requests whose grammar has compiled join the waiting queue; one whose grammar failed fails alone."""
    errors: dict[str, str] = {}
    for request in [r for r in scheduler.waiting_for_fsm if r.structured_output_request.is_compiled]:
        try:
            request.structured_output_request.take_grammar()
        except Exception as exc:
            errors[request.group_id] = f"{type(exc).__name__}: {exc}"
            continue
        scheduler.waiting_for_fsm.remove(request)
        request.status = RequestStatus.WAITING
        scheduler.waiting.append(request)
    scheduler._fail_groups(errors)


def preempt_for_priority(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Priority scheduling: while the first waiting request does not fit (sequence slots or KV blocks for its
    first chunk), preempt the lowest-priority running request if it ranks strictly below it."""
    if not scheduler.waiting:
        return
    head = scheduler.waiting[0]
    manager = scheduler.kv_cache_manager
    config = scheduler.config
    first_chunk = min(head.num_tokens - head.num_computed_tokens, config.max_num_batched_tokens)
    need = manager.num_blocks_for_tokens(head.num_computed_tokens + first_chunk)
    while candidates := _preemptible(scheduler.running, scheduler.in_flight):
        fits = (num_slots_in_use(scheduler.running) + num_sequences(head) <= config.max_num_seqs
                and manager.block_pool.num_free_blocks >= need)
        victim = scheduler.policy.pick_victim(candidates)
        if fits or not scheduler.policy.outranks(head, victim):
            return
        scheduler.running.remove(victim)
        scheduler._preempt(victim, to_front=False)
        output.preempted_req_ids.append(victim.request_id)


def admit_waiting(scheduler: Scheduler, output: SchedulerOutput, token_budget: int, limit: int) -> None:
    waiting = scheduler.waiting
    slots_in_use = num_slots_in_use(scheduler.running)
    while waiting and token_budget > 0 and len(output.scheduled) < limit:
        request = waiting[0]
        if request.request_id in output.preempted_req_ids:
            break  # preempted this step to make room: it waits for the next one
        if slots_in_use + num_sequences(request) > scheduler.config.max_num_seqs:
            break
        manager = scheduler.kv_cache_manager
        swapped = manager.is_swapped_out(request)
        computed = manager.get_computed_blocks(request) if not swapped else None
        num_cached = computed.num_blocks * manager.block_size if computed else 0
        num_new = request.num_tokens - request.num_computed_tokens - num_cached
        if num_new > token_budget and not scheduler.config.enable_chunked_prefill:
            break
        num_new = min(num_new, token_budget)
        if not manager.allocate_slots(request, num_new, computed):
            break
        waiting.popleft()
        request.status = RequestStatus.RUNNING
        if not swapped:
            manager.record_query(request)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_cached
        scheduler.running.append(request)
        slots_in_use += num_sequences(request)
        output.scheduled.append(_schedule_request(scheduler, request, num_new, output))
        token_budget -= num_new


def make_room_for_waiting(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Nothing could run: every running request is a beam waiting for a sibling that is queued and does not
    fit (in the pool, or under max_num_seqs). Preempt other requests' sequences (newest first, to the back of
    the queue) until it does; a beam group alone always fits the pool (checked when it is added)."""
    head = scheduler.waiting[0]
    manager = scheduler.kv_cache_manager
    need = manager.num_blocks_for_tokens(head.num_tokens)
    for victim in reversed(list(scheduler.running)):
        if (manager.block_pool.num_free_blocks >= need
                and num_slots_in_use(scheduler.running) + num_sequences(head) <= scheduler.config.max_num_seqs):
            break
        if victim.group_id == head.group_id:
            continue
        scheduler.running.remove(victim)
        scheduler._preempt(victim, to_front=False)
        output.preempted_req_ids.append(victim.request_id)


def _schedule_request(scheduler: Scheduler, request: Request, num_new: int, output: SchedulerOutput,
                      flight: ScheduledRequest | None = None) -> ScheduledRequest:
    """The request's part of the step, as a diff against what the workers already have (see output.py):
    a sequence they do not know yet is added to `output.new_requests` in full. With a batch of it in `flight`
    (async scheduling) it starts where that batch ends, after the token that batch samples, if any."""
    num_computed, num_known = request.num_computed_tokens, request.num_tokens
    if flight is not None:
        num_computed = flight.num_computed_tokens + flight.num_tokens
        num_known += flight.needs_sample
    needs_sample = num_computed + num_new == num_known
    scheduled = ScheduledRequest(
        request.request_id, num_new, num_computed, needs_sample=needs_sample,
        pending_token=flight is not None and flight.needs_sample,
        # n > 1: the first sample is drawn n times from the same logits, then the request forks (beams take
        # their candidates from one sample's logprobs).
        num_samples=num_sequences(request) if needs_sample and request.beam_group is None else 1)
    scheduler.worker_view.fill(scheduled, request, output)
    return scheduled
