"""Choosing one step's batch: how many tokens each running request computes, which waiting requests are admitted,
and which running requests are preempted to make room; and the batches handed out whose results are not back yet.

There are no prefill or decode phases: every request has `num_computed_tokens`, and each step the planner hands out
tokens (running requests first, then waiting ones in the policy's order, see policy.py) until the budget
`max_num_batched_tokens` or `max_num_seqs` is reached. A prompt longer than the remaining budget is split into
chunks (when chunked prefill is on), so decodes never stall behind it. A request admitted with a cached prefix (see
KVCacheManager) starts with those tokens computed.

The requests and their queues belong to RequestQueues (queues.py): the planner reads them and moves requests only
through its transitions (admit, preempt).
"""
from __future__ import annotations

from pagellm.config import SchedulerConfig
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.async_scheduling import tokens_after_flight
from pagellm.core.sched.output import ScheduledRequest, SchedulerOutput
from pagellm.core.sched.policy import SchedulingPolicy
from pagellm.core.sched.queues import RequestQueues, num_sequences, num_slots_in_use
from pagellm.core.sched.step_limits import StepLimiter, StepLimits
from pagellm.core.sched.worker_view import WorkerView
from pagellm.spec_decode.adaptive import AdaptiveDrafter
from pagellm.spec_decode.eligibility import may_speculate


class BatchPlanner:
    def __init__(self, config: SchedulerConfig, max_model_len: int, queues: RequestQueues,
                 kv_cache_manager: KVCacheManager, worker_view: WorkerView) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.queues = queues
        self.kv_cache_manager = kv_cache_manager
        self.worker_view = worker_view
        self.policy = SchedulingPolicy(config)
        self.limiter = StepLimiter(config, self.policy, max_model_len)
        spec = config.speculative_config
        self.drafter = AdaptiveDrafter(spec) if spec is not None else None
        # Sequences in a batch the workers have not returned yet (a pipeline keeps several batches in flight), with
        # their part of the newest such batch: not preempted, nor scheduled again until their results are applied
        # (with async scheduling: unless they may continue without them).
        self.in_flight: dict[str, ScheduledRequest] = {}

    def plan(self, output: SchedulerOutput, limit: int) -> None:
        """Fill `output` with at most `limit` requests, none of them in flight, and the block moves they need."""
        queues = self.queues
        order = self.policy.admission_order()
        if order is not None:
            queues.sort_waiting(order)
        limits = self._step_limits()
        self._preempt_for_priority(output, limits)
        preempted_for_priority = len(output.preempted_req_ids)

        token_budget = self._schedule_running(output, self.config.max_num_batched_tokens, limit, limits)
        # Admitting new work while running requests are short of blocks would only thrash the cache.
        if len(output.preempted_req_ids) == preempted_for_priority:
            self._admit_waiting(output, token_budget, limit, limits)
        if not output.scheduled and queues.waiting and queues.running and not self.in_flight:
            self._make_room_for_waiting(output)
            self._admit_waiting(output, token_budget, limit, limits)
        transfers = self.kv_cache_manager.take_transfers()
        output.blocks_to_swap_out, output.blocks_to_swap_in = transfers.swap_out, transfers.swap_in
        output.blocks_to_copy = transfers.copies
        # The sequences of this step that sample under a grammar (a blind one's grammar may start with the token in
        # flight, which can close its reasoning).
        output.structured_output_request_ids = [
            s.request_id for s in output.scheduled if s.needs_sample
            and (structured := queues.requests[s.request_id].structured_output_request) is not None
            and (structured.active_grammar is not None or s.pending_token)]
        self.in_flight.update((scheduled.request_id, scheduled) for scheduled in output.scheduled)
        if self.drafter is not None:
            self.drafter.step_planned(output.scheduled)

    def _step_limits(self) -> StepLimits:
        """This step's caps beyond the token budget (see step_limits.py), from the running requests with work."""
        if not self.limiter.active:
            return StepLimits(self.config.max_num_seqs)
        ready = [(r, n) for r in self.queues.running
                 if (n := self._num_next_tokens(r, self.in_flight.get(r.request_id)))]
        return self.limiter.limits(ready, self.queues.waiting)

    def land(self, output: SchedulerOutput) -> None:
        """The batch `output` is back: its sequences are no longer in flight, unless a newer batch holds them (that
        one starts later in the sequence). `output` may be a copy (it travelled to a worker process and back)."""
        for scheduled in output.scheduled:
            flight = self.in_flight.get(scheduled.request_id)
            if flight is not None and flight.num_computed_tokens <= scheduled.num_computed_tokens:
                del self.in_flight[scheduled.request_id]

    def can_schedule_ahead(self) -> bool:
        """Async scheduling: whether the next batch may be planned before the oldest in flight is back, i.e. no
        running request in flight must wait for its results (planning without it would leave it a step behind)."""
        requests = self.queues.requests
        return all(self._num_next_tokens(requests[request_id], flight) is not None
                   for request_id, flight in self.in_flight.items()
                   if request_id in requests and requests[request_id].status == RequestStatus.RUNNING)

    def _num_next_tokens(self, request: Request, flight: ScheduledRequest | None) -> int | None:
        """Tokens the request could compute this step, before the token budget; None while it must wait for its
        batch in flight."""
        if flight is None:
            return request.num_tokens - request.num_computed_tokens
        if not self.config.async_scheduling:
            return None
        drafts_next = self.drafter is not None and self.drafter.may_draft(request)
        return tokens_after_flight(request, flight, self.max_model_len, drafts_next)

    def _schedule_running(self, output: SchedulerOutput, token_budget: int, limit: int, limits: StepLimits) -> int:
        """Give the running requests their tokens, in order, preempting while the pool is short; returns the token
        budget left. Deferred requests sit the step out; prompt chunks stay within the limits' prompt budget."""
        running = self.queues.running
        index = 0
        while index < len(running) and token_budget > 0 and len(output.scheduled) < limit:
            request = running[index]
            flight = self.in_flight.get(request.request_id)
            # None or 0: a request whose last batch has not come back yet, a beam waiting for its siblings.
            num_new = self._num_next_tokens(request, flight)
            if num_new and (num_new > 1 or request.request_id in limits.held):  # a prompt chunk (or its last token)
                num_new = min(num_new, limits.prompt_budget(request, num_new))
            if not num_new or request.request_id in limits.deferred:
                index += 1
                continue
            num_new = min(num_new, token_budget)
            draft = self._draft(request, token_budget, flight) if num_new == 1 else []
            num_new += len(draft)  # look-ahead slots: the draft is verified in the same pass
            # Slots for the tokens of its batch in flight were allocated when that batch was scheduled.
            allocated = self._allocate_or_preempt(request, (flight.num_tokens if flight else 0) + num_new, index,
                                                  output)
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; the request now at `index` is the next one
            if allocated:
                scheduled = self._schedule_request(request, num_new, output, flight)
                scheduled.spec_token_ids = draft
                output.scheduled.append(scheduled)
                token_budget -= num_new
                if num_new > 1 + len(draft):
                    limits.spend_prompt(request, num_new)
            index += 1
        return token_budget

    def _draft(self, request: Request, token_budget: int, flight: ScheduledRequest | None) -> list[int]:
        """Speculative decoding: the draft tokens a decoding request verifies this step, within the token budget,
        and no more than could be emitted before max_tokens or max_model_len. A decode that runs blind (async
        scheduling: its input is the token its batch in flight samples) drafts nothing, but the drafter counts the
        step (see spec_decode/adaptive.py)."""
        if self.drafter is None or not may_speculate(request):
            return []
        if flight is not None:
            if flight.needs_sample:
                self.drafter.count_blind_step(request)
            return []
        room = min(token_budget, request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1
        return self.drafter.propose(request, room)

    def _allocate_or_preempt(self, request: Request, num_slots: int, index: int, output: SchedulerOutput) -> bool:
        """Allocate `num_slots` slots after the request's computed tokens, preempting running requests from
        `index` on (not yet scheduled this step, nor in flight) while the pool is short. False when it could not:
        the request itself was preempted, or nobody can be."""
        while not self.kv_cache_manager.allocate_slots(request, num_slots):
            candidates = self._preemptible(self.queues.running[index:])
            if not candidates:
                return False
            victim = self.policy.pick_victim(candidates)
            self._preempt(victim, output)
            if victim is request:
                return False
        return True

    def _preemptible(self, candidates: list[Request]) -> list[Request]:
        return [r for r in candidates if r.request_id not in self.in_flight] if self.in_flight else candidates

    def _preempt(self, victim: Request, output: SchedulerOutput, to_front: bool = True) -> None:
        self.queues.preempt(victim, to_front=to_front)
        output.preempted_req_ids.append(victim.request_id)

    def _preempt_for_priority(self, output: SchedulerOutput, limits: StepLimits) -> None:
        """Priority scheduling: while the first waiting request does not fit (sequence slots or KV blocks for its
        first chunk), preempt the lowest-priority running request if it ranks strictly below it."""
        queues, manager, config = self.queues, self.kv_cache_manager, self.config
        if not queues.waiting:
            return
        head = queues.waiting[0]
        first_chunk = min(head.num_tokens - head.num_computed_tokens, config.max_num_batched_tokens)
        need = manager.num_blocks_needed(head.num_computed_tokens, first_chunk)
        while candidates := self._preemptible(queues.running):
            fits = (limits.has_slots(num_slots_in_use(queues.running), num_sequences(head))
                    and manager.block_pool.num_free_blocks >= need)
            victim = self.policy.pick_victim(candidates)
            if fits or not self.policy.outranks(head, victim):
                return
            self._preempt(victim, output, to_front=False)

    def _admit_waiting(self, output: SchedulerOutput, token_budget: int, limit: int, limits: StepLimits) -> None:
        queues, manager = self.queues, self.kv_cache_manager
        slots_in_use = num_slots_in_use(queues.running)
        while queues.waiting and token_budget > 0 and len(output.scheduled) < limit:
            request = queues.waiting[0]
            if request.request_id in output.preempted_req_ids:
                break  # preempted this step to make room: it waits for the next one
            if not limits.has_slots(slots_in_use, num_sequences(request)) or not limits.may_admit(request):
                break
            swapped = manager.is_swapped_out(request)
            computed = manager.get_computed_blocks(request) if not swapped else None
            num_cached = computed.num_blocks * manager.block_size if computed else 0
            tokens_left = request.num_tokens - request.num_computed_tokens - num_cached
            if tokens_left > token_budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(tokens_left, token_budget)
            if self.config.enable_chunked_prefill:
                num_new = min(num_new, limits.prompt_budget(request, tokens_left))
                if num_new <= 0:
                    break
            if not manager.allocate_slots(request, num_new, computed):
                break
            queues.admit(request, num_cached)
            if not swapped:
                manager.record_query(request)
            slots_in_use += num_sequences(request)
            output.scheduled.append(self._schedule_request(request, num_new, output))
            token_budget -= num_new
            limits.spend_prompt(request, num_new)

    def _make_room_for_waiting(self, output: SchedulerOutput) -> None:
        """Nothing could run: every running request is a beam waiting for a sibling that is queued and does not
        fit (in the pool, or under max_num_seqs). Preempt other requests' sequences (newest first, to the back of
        the queue) until it does; a beam group alone always fits the pool (checked when it is added)."""
        queues, manager = self.queues, self.kv_cache_manager
        head = queues.waiting[0]
        need = manager.num_blocks_needed(0, head.num_tokens)
        for victim in reversed(list(queues.running)):
            if (manager.block_pool.num_free_blocks >= need
                    and num_slots_in_use(queues.running) + num_sequences(head) <= self.config.max_num_seqs):
                break
            if victim.group_id == head.group_id:
                continue
            self._preempt(victim, output, to_front=False)

    def _schedule_request(self, request: Request, num_new: int, output: SchedulerOutput,
                          flight: ScheduledRequest | None = None) -> ScheduledRequest:
        """The request's part of the step, as a diff against what the workers already have (see output.py): a
        sequence they do not know yet is added to `output.new_requests` in full. With a batch of it in `flight`
        (async scheduling) it starts where that batch ends, after the token that batch samples, if any."""
        num_computed, num_known = request.num_computed_tokens, request.num_tokens
        if flight is not None:
            num_computed = flight.num_computed_tokens + flight.num_tokens
            num_known += flight.needs_sample
        # A pooling request samples nothing: its last chunk is pooled instead.
        needs_sample = num_computed + num_new >= num_known and request.pooling_params is None
        scheduled = ScheduledRequest(
            request.request_id, num_new, num_computed, needs_sample=needs_sample,
            pending_token=flight is not None and flight.needs_sample,
            # n > 1: the first sample is drawn n times from the same logits, then the request forks (beams take
            # their candidates from one sample's logprobs).
            num_samples=num_sequences(request) if needs_sample and request.beam_group is None else 1)
        self.worker_view.fill(scheduled, request, output)
        return scheduled
