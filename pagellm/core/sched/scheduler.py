"""Continuous batching under a token budget, with chunked prefill, prefix caching and preemption.

The Scheduler owns the request queues (waiting, running, waiting for a grammar) and each request's lifecycle, and
runs the step's two halves: `schedule` builds the next batch (which requests compute how many tokens, and what is
preempted for them: sched_batch.py), and `update_from_output` applies its results (sched_results.py).

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

import sys
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

import numpy as np

from pagellm.config import SchedulerConfig
from pagellm.core.beam_group import BeamGroup
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.batch import (admit_compiled_grammars, admit_waiting, make_room_for_waiting, num_next_tokens,
                                      num_sequences, num_slots_in_use, preempt_for_priority, schedule_running)
from pagellm.core.sched.output import ScheduledRequest, SchedulerOutput
from pagellm.core.sched.policy import SchedulingPolicy
from pagellm.core.sched.results import apply_results
from pagellm.core.sched.worker_view import WorkerView
from pagellm.exceptions import InvalidRequestError
from pagellm.metrics.stats import SchedulerStats
from pagellm.structured_output.manager import StructuredOutputManager


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
        demands = ((num_sequences(r), r.num_tokens) for r in queued)
        free_seqs = self.config.max_num_seqs - num_slots_in_use(self.running)
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
        admit_compiled_grammars(self)
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        token_budget = self.config.max_num_batched_tokens
        self.policy.order_waiting(self.waiting)
        preempt_for_priority(self, output)
        preempted_for_priority = len(output.preempted_req_ids)

        limit = max_scheduled or sys.maxsize
        token_budget = schedule_running(self, output, token_budget, limit)
        # Admitting new work while running requests are short of blocks would only thrash the cache.
        if len(output.preempted_req_ids) == preempted_for_priority:
            admit_waiting(self, output, token_budget, limit)
        if not output.scheduled and self.waiting and self.running and not self.in_flight:
            make_room_for_waiting(self, output)
            admit_waiting(self, output, token_budget, limit)
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

    def can_schedule_ahead(self) -> bool:
        """Async scheduling: whether the next batch may be scheduled before the oldest in flight is collected, i.e.
        no running request in flight must wait for its results (scheduling without it would leave it a step
        behind)."""
        return all(num_next_tokens(self.requests[request_id], flight, self.config) is not None
                   for request_id, flight in self.in_flight.items()
                   if request_id in self.requests and self.requests[request_id].status == RequestStatus.RUNNING)

    def _land(self, output: SchedulerOutput) -> None:
        """The batch `output` is back: its sequences are no longer in flight, unless a newer batch holds them (that
        one starts later in the sequence). `output` may be a copy (it travelled to a worker process and back)."""
        for scheduled in output.scheduled:
            flight = self.in_flight.get(scheduled.request_id)
            if flight is not None and flight.num_computed_tokens <= scheduled.num_computed_tokens:
                del self.in_flight[scheduled.request_id]

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
        # Keyed by group: a sibling that finished earlier in this update must not hide its group's failure.
        errors = {self.requests[rid].group_id: error for rid, error in (failed or {}).items() if rid in self.requests}
        updated, finished_groups = apply_results(self, output, sampled, logprobs, prompt_logprobs, errors)
        self._finished_beam_groups += finished_groups
        if errors:
            self._fail_groups(errors)
            updated = [r for r in updated if r.group_id not in errors]
        return updated, [r for r in updated if r.is_finished]

    def take_finished_beam_groups(self) -> list[BeamGroup]:
        groups, self._finished_beam_groups = self._finished_beam_groups, []
        return groups

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
