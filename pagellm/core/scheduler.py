"""Continuous batching under a token budget, with chunked prefill, prefix caching and preemption.

There are no prefill or decode phases: every request has `num_computed_tokens`, and each step the scheduler
hands out tokens (running requests first, then waiting ones in the policy's order, see sched_policy.py) until the
budget `max_num_batched_tokens` or `max_num_seqs` is reached. A prompt longer than the remaining budget is split
into chunks (when chunked prefill is on), so decodes never stall behind it. A request admitted with a cached
prefix (see KVCacheManager) starts with those tokens computed.

With async scheduling (see async_scheduling.py) a running request may be scheduled again while a batch holding it
is still out: it then continues from where that batch leaves it, its sampled token computed blind.

When the KV pool runs out, a running request is preempted: its K/V are dropped and recomputed later, or, with
`preemption_mode="swap"`, copied to the host tier and back (recompute when the host tier is full).

Sequences of one user request (n > 1, beam search) are Requests with the same `group_id`; they are forked from
one another and share KV blocks (see KVCacheManager). Aborting a group id aborts all of them.

A request with structured outputs waits in WAITING_FOR_FSM (outside the queue, so it holds nobody up) until the
StructuredOutputManager has compiled its grammar; once running, each step's SchedulerOutput names it among the
constrained sequences, `start_grammar_bitmask` computes their token bitmask beside the forward pass, and its
grammar advances with each sampled token and finishes it when the output is complete.

A request whose results cannot be applied (an exception while updating it) fails alone: its whole group is
finished with FINISHED_ERROR, its blocks freed, and the failure reported through `take_failed_groups`; the other
requests of the step go on.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

import numpy as np

from pagellm.config import SchedulerConfig
from pagellm.core.async_scheduling import tokens_after_flight
from pagellm.core.beam_group import BeamGroup
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched_output import ScheduledRequest, SchedulerOutput
from pagellm.core.sched_policy import SchedulingPolicy
from pagellm.core.worker_view import WorkerView
from pagellm.exceptions import InvalidRequestError
from pagellm.logger import init_logger
from pagellm.metrics.stats import SchedulerStats
from pagellm.structured_output.manager import StructuredOutputManager

logger = init_logger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.structured_output_manager = structured_output_manager
        self.waiting_for_fsm: list[Request] = []  # grammars compiling, in arrival order
        self.policy = SchedulingPolicy(config)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self._finished_req_ids: list[str] = []
        # Sequences in a batch the workers have not returned yet (a pipeline keeps several batches in flight), with
        # their part of the newest such batch: not preempted, nor scheduled again until their results are applied
        # (with async scheduling: unless they may continue without them).
        self.in_flight: dict[str, ScheduledRequest] = {}
        self.num_preemptions_total = 0
        self.groups: dict[str, set[str]] = {}  # group id -> ids of its live sequences
        self._finished_beam_groups: list[BeamGroup] = []
        self._failed_groups: dict[str, str] = {}  # group id -> why it failed, until taken
        self.worker_view = WorkerView(kv_cache_manager)  # what the workers hold of each sequence

    # ---- request lifecycle -------------------------------------------------------------------------------
    def add_request(self, request: Request, beam_group: BeamGroup | None = None) -> None:
        if request.group_id in self.groups or request.request_id in self.requests:
            raise InvalidRequestError(f"Request id {request.group_id!r} is already in use; give each request a "
                                      f"unique id.")
        if beam_group is not None:
            request.beam_group = beam_group
            beam_group.beams = [request]
        if request.structured_output_request is not None:
            if self.structured_output_manager is None:
                raise InvalidRequestError("This scheduler has no structured output manager; drop "
                                          "sampling_params.structured_outputs.")
            self.structured_output_manager.grammar_init(request.structured_output_request)
            self._track(request)
            self.waiting_for_fsm.append(request)
            return
        self._track(request)
        self.waiting.append(request)

    def _track(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.groups.setdefault(request.group_id, set()).add(request.request_id)

    def abort_requests(self, group_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Finish every sequence of these requests (user request ids), aborted unless told otherwise."""
        request_ids = [rid for gid in group_ids for rid in sorted(self.groups.get(gid, ()))]
        return self.finish_requests(request_ids, status)

    def fail_requests(self, errors: dict[str, str]) -> None:
        """Sequence id -> why it failed: fail the groups of those still live (see `_fail_groups`)."""
        self._fail_groups({self.requests[rid].group_id: error for rid, error in errors.items()
                           if rid in self.requests})

    def _fail_groups(self, errors: dict[str, str]) -> None:
        """Group id -> why it failed: finish every sequence of each group with FINISHED_ERROR (siblings too: the
        user asked for them together) and keep the reason for `take_failed_groups`."""
        for group_id, error in errors.items():
            self._failed_groups.setdefault(group_id, error)
            self.abort_requests([group_id], RequestStatus.FINISHED_ERROR)

    def recover_from_failed_step(self, output: SchedulerOutput, error: str) -> None:
        """A step failed as a whole, perhaps before its block copies: fail the requests it ran, recompute the ones
        it swapped out instead of trusting their host copies, and forget cached blocks nobody holds."""
        self._land(output)
        self.fail_requests({r.request_id: error for r in output.scheduled})
        manager = self.kv_cache_manager
        for request_id in output.preempted_req_ids:
            request = self.requests.get(request_id)
            if request is not None and manager.is_swapped_out(request):
                manager.free(request)
                request.num_computed_tokens = 0
        manager.reset_prefix_cache()

    def take_failed_groups(self) -> dict[str, str]:
        failed, self._failed_groups = self._failed_groups, {}
        return failed

    def finish_requests(self, request_ids: list[str], status: RequestStatus,
                        stop_reasons: dict[str, int | str] | None = None) -> list[Request]:
        """Finish requests from outside the step (aborts; stop strings found in the detokenized text) and free
        their blocks at once. Unknown or already finished ids are ignored. Returns the requests finished."""
        assert status.is_finished, status
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_FSM:
                self.waiting_for_fsm.remove(request)
            else:
                self.waiting.remove(request)
            if stop_reasons and request_id in stop_reasons:
                request.stop_reason = stop_reasons[request_id]
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_fsm)

    @property
    def num_unfinished(self) -> int:
        """Sequences waiting or running (in flight or not)."""
        return len(self.waiting) + len(self.running)

    def check_consistency(self) -> None:
        """Raise RuntimeError unless the queues hold exactly the live requests and the KV block accounting is
        exact."""
        queues = (self.running, self.waiting, self.waiting_for_fsm)
        queued = {r.request_id for queue in queues for r in queue}
        if queued != set(self.requests) or len(queued) != sum(map(len, queues)):
            raise RuntimeError("The scheduler's queues disagree with its live requests.")
        self.kv_cache_manager.check_consistency(set(self.requests))

    def num_waiting_for_capacity(self) -> int:
        """Waiting requests that could not start now even with an unlimited token budget: counting from the head
        of the queue, those beyond the free sequence slots (n each) or the free KV blocks (their tokens so far).
        A burst that fits is not a backlog. Requests whose grammar compiles count as queued behind the others."""
        queued = [*self.waiting, *self.waiting_for_fsm]
        demands = ((self._num_sequences(r), r.num_tokens) for r in queued)
        free_seqs = self.config.max_num_seqs - self._num_slots_in_use()
        free_blocks = self.kv_cache_manager.block_pool.num_free_blocks
        return len(queued) - self.num_fitting(demands, free_seqs, free_blocks)

    def num_fitting(self, demands: Iterable[tuple[int, int]], free_seqs: int | None = None,
                    free_blocks: int | None = None) -> int:
        """How many of these (sequence slots, tokens) demands, taken in order, fit the free slots and KV blocks
        (by default: all of them, as in an idle engine). Reads only constants when defaulted, so any thread may
        ask."""
        free_seqs = self.config.max_num_seqs if free_seqs is None else free_seqs
        free_blocks = self.kv_cache_manager.num_blocks if free_blocks is None else free_blocks
        fitting = 0
        for num_seqs, num_tokens in demands:
            free_seqs -= num_seqs
            free_blocks -= self.kv_cache_manager.num_blocks_for_tokens(num_tokens)
            if free_seqs < 0 or free_blocks < 0:
                break
            fitting += 1
        return fitting

    def stats(self) -> SchedulerStats:
        manager = self.kv_cache_manager
        pool, host_pool, prefix = manager.block_pool, manager.host_pool, manager.prefix_stats
        efficiency = manager.token_efficiency({r.request_id: r.num_computed_tokens for r in self.running})
        return SchedulerStats(
            len(self.running), len(self.waiting) + len(self.waiting_for_fsm), pool.num_used_blocks, pool.num_blocks,
            self.num_preemptions_total,
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            prefix_cache_preempted_queries=prefix.preempted_queries,
            prefix_cache_preempted_hits=prefix.preempted_hits, kv_cache_token_efficiency=efficiency,
            num_used_host_blocks=host_pool.num_used_blocks if host_pool else 0,
            num_host_blocks=host_pool.num_blocks if host_pool else 0,
            num_swapped_out_blocks_total=manager.num_swapped_out_blocks,
            num_swapped_in_blocks_total=manager.num_swapped_in_blocks)

    # ---- one step ----------------------------------------------------------------------------------------
    def schedule(self, max_scheduled: int | None = None) -> SchedulerOutput:
        """The next batch: at most `max_scheduled` requests (a pipeline splits its requests into a batch per stage,
        so that the stages overlap), none of them in flight."""
        self._admit_compiled_grammars()
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        token_budget = self.config.max_num_batched_tokens
        self.policy.order_waiting(self.waiting)
        self._preempt_for_priority(output)
        preempted_for_priority = len(output.preempted_req_ids)

        index = 0
        limit = max_scheduled or sys.maxsize
        while index < len(self.running) and token_budget > 0 and len(output.scheduled) < limit:
            request = self.running[index]
            flight = self.in_flight.get(request.request_id)
            # None or 0: a request whose last batch has not come back yet, a beam waiting for its siblings.
            num_new = self._num_next_tokens(request, flight)
            if not num_new:
                index += 1
                continue
            num_new = min(num_new, token_budget)
            # Slots for the tokens of its batch in flight were allocated when that batch was scheduled.
            allocated = self._allocate_or_preempt(request, (flight.num_tokens if flight else 0) + num_new, index,
                                                  output)
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; the request now at `index` is the next one
            if allocated:
                output.scheduled.append(self._schedule(request, num_new, output, flight))
                token_budget -= num_new
            index += 1

        # Admitting new work while running requests are short of blocks would only thrash the cache.
        if len(output.preempted_req_ids) == preempted_for_priority:
            self._admit_waiting(output, token_budget, limit)
        if not output.scheduled and self.waiting and self.running and not self.in_flight:
            self._make_room_for_waiting(output)
            self._admit_waiting(output, token_budget, limit)
        transfers = self.kv_cache_manager.take_transfers()
        output.blocks_to_swap_out, output.blocks_to_swap_in = transfers.swap_out, transfers.swap_in
        output.blocks_to_copy = transfers.copies
        self._mark_constrained(output)
        if output.is_empty:
            # Nothing for the workers to do (everything is in flight): the sequences they drop go with the next
            # batch instead.
            self._finished_req_ids = output.finished_req_ids + output.preempted_req_ids + self._finished_req_ids
            output.finished_req_ids, output.preempted_req_ids = [], []
        self.in_flight.update((scheduled.request_id, scheduled) for scheduled in output.scheduled)
        return output

    def _num_next_tokens(self, request: Request, flight: ScheduledRequest | None) -> int | None:
        """Tokens the request could compute this step, before the token budget; None while it must wait for its
        batch in flight."""
        if flight is None:
            return request.num_tokens - request.num_computed_tokens
        if not self.config.async_scheduling:
            return None
        return tokens_after_flight(request, flight, self.config.max_model_len)

    def can_schedule_ahead(self) -> bool:
        """Async scheduling: whether the next batch may be scheduled before the oldest in flight is collected, i.e.
        no running request in flight must wait for its results (scheduling without it would leave it a step
        behind)."""
        return all(self._num_next_tokens(self.requests[request_id], flight) is not None
                   for request_id, flight in self.in_flight.items()
                   if request_id in self.requests and self.requests[request_id].status == RequestStatus.RUNNING)

    def _allocate_or_preempt(self, request: Request, num_slots: int, index: int, output: SchedulerOutput) -> bool:
        """Allocate `num_slots` slots after the request's computed tokens, preempting running requests from
        `index` on (not yet scheduled this step, nor in flight) while the pool is short. False when it could not:
        the request itself was preempted, or nobody can be."""
        while not self.kv_cache_manager.allocate_slots(request, num_slots):
            candidates = self._preemptible(self.running[index:])
            if not candidates:
                return False
            victim = self.policy.pick_victim(candidates)
            self.running.remove(victim)
            self._preempt(victim)
            output.preempted_req_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _land(self, output: SchedulerOutput) -> None:
        """The batch `output` is back: its sequences are no longer in flight, unless a newer batch holds them (that
        one starts later in the sequence). `output` may be a copy (it travelled to a worker process and back)."""
        for scheduled in output.scheduled:
            flight = self.in_flight.get(scheduled.request_id)
            if flight is not None and flight.num_computed_tokens <= scheduled.num_computed_tokens:
                del self.in_flight[scheduled.request_id]

    def _preemptible(self, candidates: list[Request]) -> list[Request]:
        return [r for r in candidates if r.request_id not in self.in_flight] if self.in_flight else candidates

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar has compiled join the waiting queue; one whose grammar failed fails alone."""
        errors: dict[str, str] = {}
        for request in [r for r in self.waiting_for_fsm if r.structured_output_request.is_compiled]:
            try:
                request.structured_output_request.take_grammar()
            except Exception as exc:
                errors[request.group_id] = f"{type(exc).__name__}: {exc}"
                continue
            self.waiting_for_fsm.remove(request)
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
        self._fail_groups(errors)

    def _mark_constrained(self, output: SchedulerOutput) -> None:
        """Name the sequences of this step that sample under a grammar."""
        output.structured_output_request_ids = [
            s.request_id for s in output.scheduled
            if s.needs_sample and self.requests[s.request_id].structured_output_request is not None]

    def start_grammar_bitmask(self, output: SchedulerOutput) -> Future[np.ndarray] | None:
        """Start computing the allowed tokens of the step's constrained sequences (one packed row each, in
        `structured_output_request_ids` order) on the manager's bitmask thread; None when there are none. Their
        grammars only advance once the step's results are applied, so nothing changes them meanwhile. With async
        scheduling a step whose constrained sequences continue blind asks only once the step before is applied;
        a sequence that step finished gets no grammar (its row allows everything; its token is dropped)."""
        if not output.structured_output_request_ids:
            return None
        return self.structured_output_manager.submit_bitmask(
            [self.requests[request_id].structured_output_request.grammar if request_id in self.requests else None
             for request_id in output.structured_output_request_ids])

    def needs_late_bitmask(self, output: SchedulerOutput) -> bool:
        """Async scheduling: whether a constrained sequence of `output` continues blind, so that its bitmask needs
        the grammar advanced by the token of the batch still in flight."""
        constrained = set(output.structured_output_request_ids)
        return any(s.pending_token and s.request_id in constrained for s in output.scheduled)

    def _preempt_for_priority(self, output: SchedulerOutput) -> None:
        """Priority scheduling: while the first waiting request does not fit (sequence slots or KV blocks for its
        first chunk), preempt the lowest-priority running request if it ranks strictly below it."""
        if not self.waiting:
            return
        head = self.waiting[0]
        manager = self.kv_cache_manager
        first_chunk = min(head.num_tokens - head.num_computed_tokens, self.config.max_num_batched_tokens)
        need = manager.num_blocks_for_tokens(head.num_computed_tokens + first_chunk)
        while candidates := self._preemptible(self.running):
            fits = (self._num_slots_in_use() + self._num_sequences(head) <= self.config.max_num_seqs
                    and manager.block_pool.num_free_blocks >= need)
            victim = self.policy.pick_victim(candidates)
            if fits or not self.policy.outranks(head, victim):
                return
            self.running.remove(victim)
            self._preempt(victim, to_front=False)
            output.preempted_req_ids.append(victim.request_id)

    def _admit_waiting(self, output: SchedulerOutput, token_budget: int, limit: int) -> None:
        slots_in_use = self._num_slots_in_use()
        while self.waiting and token_budget > 0 and len(output.scheduled) < limit:
            request = self.waiting[0]
            if request.request_id in output.preempted_req_ids:
                break  # preempted this step to make room: it waits for the next one
            if slots_in_use + self._num_sequences(request) > self.config.max_num_seqs:
                break
            manager = self.kv_cache_manager
            swapped = manager.is_swapped_out(request)
            computed = manager.get_computed_blocks(request) if not swapped else None
            num_cached = computed.num_blocks * manager.block_size if computed else 0
            num_new = request.num_tokens - request.num_computed_tokens - num_cached
            if num_new > token_budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, token_budget)
            if not manager.allocate_slots(request, num_new, computed):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if not swapped:
                manager.record_query(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
            self.running.append(request)
            slots_in_use += self._num_sequences(request)
            output.scheduled.append(self._schedule(request, num_new, output))
            token_budget -= num_new

    @staticmethod
    def _num_sequences(request: Request) -> int:
        """Sequence slots a request takes: n for one that will fork at its first sample, beam_width for the first
        beam of a beam search (the slots of its future sequences are held from admission on, prefill chunks
        included, so forks never take the running count over max_num_seqs), else one."""
        if request.num_output_tokens:
            return 1
        if request.beam_group is not None:
            return request.beam_group.params.beam_width if len(request.beam_group.beams) == 1 else 1
        return request.sampling_params.n

    def _num_slots_in_use(self) -> int:
        return sum(self._num_sequences(r) for r in self.running)

    def _make_room_for_waiting(self, output: SchedulerOutput) -> None:
        """Nothing could run: every running request is a beam waiting for a sibling that is queued and does not
        fit (in the pool, or under max_num_seqs). Preempt other requests' sequences (newest first, to the back of
        the queue) until it does; a beam group alone always fits the pool (checked when it is added)."""
        head = self.waiting[0]
        need = self.kv_cache_manager.num_blocks_for_tokens(head.num_tokens)
        for victim in reversed(list(self.running)):
            if (self.kv_cache_manager.block_pool.num_free_blocks >= need
                    and self._num_slots_in_use() + self._num_sequences(head) <= self.config.max_num_seqs):
                break
            if victim.group_id == head.group_id:
                continue
            self.running.remove(victim)
            self._preempt(victim, to_front=False)
            output.preempted_req_ids.append(victim.request_id)

    def _schedule(self, request: Request, num_new: int, output: SchedulerOutput,
                  flight: ScheduledRequest | None = None) -> ScheduledRequest:
        """The request's part of the step, as a diff against what the workers already have (see sched_output.py):
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
            num_samples=self._num_sequences(request) if needs_sample and request.beam_group is None else 1)
        self.worker_view.fill(scheduled, request, output)
        return scheduled

    def _preempt(self, request: Request, to_front: bool = True) -> None:
        """Swap the request's K/V out to the host tier (preemption_mode="swap", when the host tier has room and
        the request is not a beam) or drop them to be recomputed, keep the tokens, and go back in line (to its
        front under fcfs). The workers drop it; it is sent to them in full when it resumes."""
        self.worker_view.forget(request.request_id)
        manager = self.kv_cache_manager
        if (self.config.preemption_mode == "swap" and request.beam_group is None
                and manager.can_swap_out(request)):
            manager.swap_out(request)
        else:
            manager.free(request)
            request.num_computed_tokens = 0
            request.beam_candidates = None  # sampled again after the recompute
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if to_front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    # ---- results -----------------------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]],
                           logprobs: dict[str, list] | None = None, prompt_logprobs: dict | None = None,
                           failed: dict[str, str] | None = None) -> tuple[list[Request], list[Request]]:
        """Advance every scheduled request; returns (requests that got a new token, requests that finished).

        `sampled`: request id -> its sampled tokens (n of them when the request forks into n sequences).
        `logprobs`: request id -> one (ids, logprobs, ranks) entry per sampled token, the token first, then top-k.
        `prompt_logprobs`: request id -> (index of the first entry, entries) for this step's prompt chunk;
        entries a preempted request already has (recomputed prefill) are not appended again.
        `failed`: request id -> why the worker could not compute it; those requests (and any whose update raises)
        fail with their groups (`fail_requests`) and are left out of the returned lists.
        Beams get no token here: their candidates are stored, and their group advances once all have them."""
        self.kv_cache_manager.finish_step()  # the step's block copies are done
        self._land(output)
        updated: list[Request] = []
        ready_groups: dict[str, BeamGroup] = {}
        # Keyed by group: a sibling that finished earlier in this update must not hide its group's failure.
        errors = {self.requests[rid].group_id: error for rid, error in (failed or {}).items() if rid in self.requests}
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.group_id in errors:  # aborted while the step ran, or its group failed
                continue
            try:
                updated += self._update_request(request, scheduled, sampled, logprobs, prompt_logprobs)
            except Exception as exc:
                logger.exception("Updating request %s failed; it fails alone.", request.request_id)
                errors[request.group_id] = f"{type(exc).__name__}: {exc}"
                continue
            if request.beam_group is not None and request.beam_group.ready:
                ready_groups[request.group_id] = request.beam_group
        for group_id, group in ready_groups.items():
            if group_id in errors:
                continue
            try:
                self._advance_beams(group)
            except Exception as exc:
                logger.exception("Advancing beam search %s failed; it fails alone.", group_id)
                errors[group_id] = f"{type(exc).__name__}: {exc}"
        if errors:
            self._fail_groups(errors)
            updated = [r for r in updated if r.group_id not in errors]
        return updated, [r for r in updated if r.is_finished]

    def _update_request(self, request: Request, scheduled: ScheduledRequest, sampled: dict[str, list[int]],
                        logprobs: dict[str, list] | None, prompt_logprobs: dict | None) -> list[Request]:
        """Apply one scheduled request's results; returns its sequences that got a token (several when it
        forks)."""
        request.num_computed_tokens += scheduled.num_tokens
        self.kv_cache_manager.cache_full_blocks(request)
        if prompt_logprobs and request.request_id in prompt_logprobs:
            first, entries = prompt_logprobs[request.request_id]
            have = len(request.prompt_logprobs)
            if first <= have:
                request.prompt_logprobs.extend(entries[have - first:])
        if not scheduled.needs_sample:
            return []
        entries = (logprobs or {}).get(request.request_id) or [None] * scheduled.num_samples
        if request.beam_group is not None:
            ids, values, _ = entries[0]
            request.beam_candidates = (ids[1:], values[1:])  # the top-k, after the sampled (argmax) token
            return []
        tokens = sampled[request.request_id]
        sequences = [request] + self._fork_samples(request, len(tokens) - 1)
        for sequence, token, entry in zip(sequences, tokens, entries):
            if entry is not None:
                sequence.logprobs.append(entry)
                sequence.cumulative_logprob += entry[1][0]
            sequence.append_output_token(token)
            structured = sequence.structured_output_request
            if structured is not None and not structured.grammar.accept_tokens([token]):
                raise RuntimeError(f"Sampled token {token} is not allowed by the request's structured output "
                                   f"grammar.")
            status = self._check_stop(sequence)
            if status is not None:
                self.running.remove(sequence)
                self._finish(sequence, status)
        return sequences

    def _fork_samples(self, request: Request, num_forks: int) -> list[Request]:
        """n > 1: sequences 1..n-1 of `request`, sharing its blocks, running right after it. With a seed, sequence
        i continues from seed + i."""
        children = []
        position = self.running.index(request) + 1
        for index in range(1, num_forks + 1):
            params = request.sampling_params
            params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index)
            child = request.fork(f"{request.group_id}/{index}", index, params)
            self.kv_cache_manager.fork(request, child)
            self._track(child)
            self.running.insert(position, child)
            position += 1
            children.append(child)
        return children

    def _advance_beams(self, group: BeamGroup) -> None:
        """Apply the group's choice: beams chosen k times fork k - 1 copies, beams not chosen are freed."""
        choices = group.select()
        by_parent: dict[Request, list] = {}
        for choice in choices:
            by_parent.setdefault(choice.parent, []).append(choice)
        for beam in group.beams:
            beam.beam_candidates = None
            if beam not in by_parent:
                self.running.remove(beam)
                self._finish(beam, RequestStatus.FINISHED_ABORTED)
        beams = []
        for parent, picks in by_parent.items():
            # Forks copy the parent's tokens, so they are made before the parent takes its own next token.
            for choice in picks[1:]:
                child = parent.fork(group.next_beam_id(), 0)
                self.kv_cache_manager.fork(parent, child)
                self._track(child)
                self.running.insert(self.running.index(parent) + 1, child)
                child.append_output_token(choice.token_id)
                child.cumulative_logprob = choice.cum_logprob
                beams.append(child)
            parent.append_output_token(picks[0].token_id)
            parent.cumulative_logprob = picks[0].cum_logprob
            beams.append(parent)
        beams.sort(key=lambda b: b.cumulative_logprob, reverse=True)
        group.beams = beams
        if group.is_done(self.config.max_model_len):
            for beam in beams:
                self.running.remove(beam)
                self._finish(beam, RequestStatus.FINISHED_LENGTH)
            group.finish()
            self._finished_beam_groups.append(group)

    def take_finished_beam_groups(self) -> list[BeamGroup]:
        groups, self._finished_beam_groups = self._finished_beam_groups, []
        return groups

    def _check_stop(self, request: Request) -> RequestStatus | None:
        token = request.output_token_ids[-1]
        params = request.sampling_params
        if not params.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        structured = request.structured_output_request
        if structured is not None and structured.grammar.is_terminated():  # the output is complete
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.worker_view.forget(request.request_id)
        request.status = status
        self.kv_cache_manager.free(request)
        self._finished_req_ids.append(request.request_id)
        del self.requests[request.request_id]
        members = self.groups[request.group_id]
        members.discard(request.request_id)
        if not members:
            del self.groups[request.group_id]
