"""Continuous batching under a token budget, with chunked prefill, prefix caching and preemption.

The Scheduler is the engine's one entry point to scheduling, a facade over parts that own their state and never
reach into one another: RequestQueues (queues.py) holds the live requests and their queues (waiting, running,
waiting for a grammar) and makes every transition between them; BatchPlanner (batch.py) chooses each step's batch
(which requests compute how many tokens, and what is preempted for them) and remembers the batches in flight;
ResultApplier (results.py) applies a step's results. `schedule` and `update_from_output` are the step's two halves.

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
from pagellm.core.sched.batch import BatchPlanner
from pagellm.core.sched.output import ScheduledRequest, SchedulerOutput
from pagellm.core.sched.queues import RequestQueues, num_sequences, num_slots_in_use
from pagellm.core.sched.results import ResultApplier
from pagellm.core.sched.worker_view import WorkerView
from pagellm.exceptions import InvalidRequestError
from pagellm.metrics.stats import SchedulerStats
from pagellm.spec_decode.metrics import SpecDecodingStats
from pagellm.structured_output.manager import StructuredOutputManager


class Scheduler:
    def __init__(self, config: SchedulerConfig, max_model_len: int, kv_cache_manager: KVCacheManager,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        """`max_model_len` (the model config's): no sequence grows past it."""
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.structured_output_manager = structured_output_manager
        worker_view = WorkerView(kv_cache_manager)  # what the workers hold of each sequence
        self.queues = RequestQueues(config, kv_cache_manager, worker_view)
        self.planner = BatchPlanner(config, max_model_len, self.queues, kv_cache_manager, worker_view)
        self.applier = ResultApplier(max_model_len, self.queues, kv_cache_manager, self.planner.drafter)
        # Ids the workers must drop that no batch has carried yet (a step with nothing to run is not sent).
        self._unsent_dropped_ids: list[str] = []
        self._finished_beam_groups: list[BeamGroup] = []

    # ---- the parts' state, for readers -------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, Request]:
        return self.queues.requests

    @property
    def groups(self) -> dict[str, set[str]]:
        return self.queues.groups

    @property
    def waiting(self) -> deque[Request]:
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def waiting_for_fsm(self) -> list[Request]:
        return self.queues.waiting_for_fsm

    @property
    def in_flight(self) -> dict[str, ScheduledRequest]:
        return self.planner.in_flight

    @property
    def num_preemptions_total(self) -> int:
        return self.queues.num_preemptions_total

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats:
        """Speculative decoding's cumulative counters (zero when it is off)."""
        return self.applier.spec_stats

    # ---- request lifecycle -------------------------------------------------------------------------------
    def add_request(self, request: Request, beam_group: BeamGroup | None = None) -> None:
        self.queues.check_id_unused(request)
        if beam_group is not None:
            request.beam_group = beam_group
            beam_group.beams = [request]
        if request.structured_output_request is not None:
            if self.structured_output_manager is None:
                raise InvalidRequestError("This scheduler has no structured output manager; drop "
                                          "sampling_params.structured_outputs.")
            self.structured_output_manager.grammar_init(request.structured_output_request)
        self.queues.add(request)

    def abort_requests(self, group_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Finish every sequence of these requests (user request ids), aborted unless told otherwise."""
        return self.queues.finish_groups(group_ids, status)

    def fail_requests(self, errors: dict[str, str]) -> None:
        """Sequence id -> why it failed: fail the groups of those still live (see `RequestQueues.fail`)."""
        self.queues.fail({self.requests[rid].group_id: error for rid, error in errors.items()
                          if rid in self.requests})

    def recover_from_failed_step(self, output: SchedulerOutput, error: str) -> None:
        """A step failed as a whole, perhaps before its block copies: fail the requests it ran, recompute the ones
        it swapped out instead of trusting their host copies, and forget cached blocks nobody holds."""
        self.planner.land(output)
        self.fail_requests({r.request_id: error for r in output.scheduled})
        self.queues.recompute_swapped(output.preempted_req_ids)
        self.kv_cache_manager.reset_prefix_cache()

    def take_failed_groups(self) -> dict[str, str]:
        return self.queues.take_failed_groups()

    def finish_requests(self, request_ids: list[str], status: RequestStatus,
                        stop_reasons: dict[str, int | str] | None = None) -> list[Request]:
        """Finish requests from outside the step (stop strings found in the detokenized text) and free their
        blocks at once. Unknown or already finished ids are ignored. Returns the requests finished."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if stop_reasons and request_id in stop_reasons:
                request.stop_reason = stop_reasons[request_id]
            self.queues.finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return self.queues.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        """Sequences waiting or running (in flight or not)."""
        return len(self.waiting) + len(self.running)

    def check_consistency(self) -> None:
        """Raise RuntimeError unless the queues hold exactly the live requests and the KV block accounting is
        exact."""
        self.queues.check_consistency()
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
            # A sliding window holds only its blocks: at most those of the last chunk of the prompt and the window.
            chunk = min(num_tokens, self.config.max_num_batched_tokens)
            free_blocks -= self.kv_cache_manager.num_blocks_needed(num_tokens - chunk, chunk)
            if free_seqs < 0 or free_blocks < 0:
                break
            fitting += 1
        return fitting

    def stats(self) -> SchedulerStats:
        manager = self.kv_cache_manager
        pool, host_pool, prefix = manager.block_pool, manager.host_pool, manager.prefix_stats
        efficiency = manager.token_efficiency({r.request_id: r.num_computed_tokens for r in self.running})
        spec = self.applier.spec_stats
        return SchedulerStats(
            len(self.running), len(self.waiting) + len(self.waiting_for_fsm), pool.num_used_blocks, pool.num_blocks,
            self.num_preemptions_total,
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            prefix_cache_preempted_queries=prefix.preempted_queries,
            prefix_cache_preempted_hits=prefix.preempted_hits, kv_cache_token_efficiency=efficiency,
            num_used_host_blocks=host_pool.num_used_blocks if host_pool else 0,
            num_host_blocks=host_pool.num_blocks if host_pool else 0,
            num_swapped_out_blocks_total=manager.num_swapped_out_blocks,
            num_swapped_in_blocks_total=manager.num_swapped_in_blocks,
            spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos),
            num_kv_cache_groups=len(manager.groups))

    # ---- one step ----------------------------------------------------------------------------------------
    def schedule(self, max_scheduled: int | None = None) -> SchedulerOutput:
        """The next batch: at most `max_scheduled` requests (a pipeline splits its requests into a batch per stage,
        so that the stages overlap), none of them in flight."""
        self.queues.move_compiled_to_waiting()
        output = SchedulerOutput(finished_req_ids=self._unsent_dropped_ids + self.queues.take_finished_req_ids())
        self._unsent_dropped_ids = []
        self.planner.plan(output, max_scheduled or sys.maxsize)
        if output.is_empty:
            # Nothing for the workers to do (everything is in flight): the sequences they drop go with the next
            # batch instead.
            self._unsent_dropped_ids = output.finished_req_ids + output.preempted_req_ids
            output.finished_req_ids, output.preempted_req_ids = [], []
        return output

    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """The engine measured how long the step `output` took: the latency target's model of step time learns
        from it (see step_limits.py; nothing happens without a target)."""
        self.planner.limiter.observe(output, seconds)

    def can_schedule_ahead(self) -> bool:
        """Async scheduling: whether the next batch may be scheduled before the oldest in flight is collected."""
        return self.planner.can_schedule_ahead()

    def start_grammar_bitmask(self, output: SchedulerOutput) -> Future[np.ndarray] | None:
        """Start computing the allowed tokens of the step's constrained sequences (one packed row each, in
        `structured_output_request_ids` order) on the manager's bitmask thread; None when there are none. Their
        grammars only advance once the step's results are applied, so nothing changes them meanwhile. With async
        scheduling a step whose constrained sequences continue blind asks only once the step before is applied;
        a sequence that step finished gets no grammar (its row allows everything; its token is dropped), as does
        one still inside its reasoning (see structured_output/request.py). A sequence verifying a draft gets a row
        per verified position (the grammar's state after the drafts before it)."""
        if not output.structured_output_request_ids:
            return None
        drafts = {s.request_id: s.spec_token_ids for s in output.scheduled if s.spec_token_ids}
        return self.structured_output_manager.submit_bitmask(
            [self.requests[request_id].structured_output_request.active_grammar if request_id in self.requests
             else None for request_id in output.structured_output_request_ids],
            [drafts.get(request_id, []) for request_id in output.structured_output_request_ids])

    def needs_late_bitmask(self, output: SchedulerOutput) -> bool:
        """Async scheduling: whether a constrained sequence of `output` continues blind, so that its bitmask needs
        the grammar advanced by the token of the batch still in flight."""
        constrained = set(output.structured_output_request_ids)
        return any(s.pending_token and s.request_id in constrained for s in output.scheduled)

    # ---- results -----------------------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]],
                           logprobs: dict[str, list] | None = None, prompt_logprobs: dict | None = None,
                           failed: dict[str, str] | None = None,
                           pooled: dict[str, np.ndarray] | None = None,
                           draft_token_ids: dict[str, list[int]] | None = None) -> tuple[list[Request], list[Request]]:
        """Advance every scheduled request; returns (requests that got a new token, requests that finished).

        `sampled`: request id -> its sampled tokens (n of them when the request forks into n sequences).
        `logprobs`: request id -> one (ids, logprobs, ranks) entry per sampled token, the token first, then top-k.
        `prompt_logprobs`: request id -> (index of the first entry, entries) for this step's prompt chunk;
        entries a preempted request already has (recomputed prefill) are not appended again.
        `pooled`: request id -> the pooled contribution of a pooling request's chunk (it finishes with its prompt).
        `draft_token_ids`: request id -> the draft the worker's draft model put in its placeholder slots.
        `failed`: request id -> why the worker could not compute it; those requests (and any whose update raises)
        fail with their groups (`fail_requests`) and are left out of the returned lists.
        Beams get no token here: their candidates are stored, and their group advances once all have them."""
        self.kv_cache_manager.finish_step()  # the step's block copies are done
        self.planner.land(output)
        # Keyed by group: a sibling that finished earlier in this update must not hide its group's failure.
        errors = {self.requests[rid].group_id: error for rid, error in (failed or {}).items() if rid in self.requests}
        updated, finished_groups = self.applier.apply(output, sampled, logprobs, prompt_logprobs, errors, pooled,
                                                      draft_token_ids)
        self._finished_beam_groups += finished_groups
        if errors:
            self.queues.fail(errors)
            updated = [r for r in updated if r.group_id not in errors]
        return updated, [r for r in updated if r.is_finished]

    def take_finished_beam_groups(self) -> list[BeamGroup]:
        groups, self._finished_beam_groups = self._finished_beam_groups, []
        return groups
