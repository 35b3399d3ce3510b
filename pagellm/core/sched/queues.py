"""The live requests and every move between the scheduler's queues.

`RequestQueues` owns the request map, the groups (the sequences of one user request: n > 1, beam search), the three
queues and what follows from leaving them (the ids the workers must drop, the groups that failed, the preemption
count). Others may read the queues; only its named transitions change them, batch choice (batch.py) and result
application (results.py) included, and each transition does all of its bookkeeping.

    add        new request -> waiting, or waiting_for_fsm while its grammar compiles
               (`move_compiled_to_waiting`: -> waiting once compiled)
    admit      waiting -> running
    preempt    running -> waiting: K/V swapped out to the host tier or dropped for recompute
    fork       new sequences of a running one, sharing its blocks, running right after it
    finish     any queue -> gone: blocks freed, the workers told to drop it
    fail       every sequence of a group -> finished with FINISHED_ERROR, the reason kept

It also says how many sequence slots a request takes (`num_sequences`), the unit of max_num_seqs.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from pagellm.config import SchedulerConfig
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.worker_view import WorkerView
from pagellm.exceptions import InvalidRequestError


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


class RequestQueues:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, worker_view: WorkerView) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.worker_view = worker_view
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, set[str]] = {}  # group id -> ids of its live sequences
        self.waiting_for_fsm: list[Request] = []  # grammars compiling, in arrival order
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.num_preemptions_total = 0
        self._finished_req_ids: list[str] = []  # finished since the last take: the workers drop them
        self._failed_groups: dict[str, str] = {}  # group id -> why it failed, until taken

    # ---- transitions -------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A new request joins the back of the waiting queue, or waits for its grammar outside it (so that it holds
        nobody up)."""
        self._track(request)
        if request.structured_output_request is not None:
            self.waiting_for_fsm.append(request)
        else:
            self.waiting.append(request)

    def move_compiled_to_waiting(self) -> None:
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
        self.fail(errors)

    def sort_waiting(self, key: Callable[[Request], Any]) -> None:
        """Put the waiting queue in this order (a stable sort: equals keep their places)."""
        ordered = sorted(self.waiting, key=key)
        self.waiting.clear()
        self.waiting.extend(ordered)

    def admit(self, request: Request, num_cached_tokens: int) -> None:
        """The waiting request starts running (its blocks are allocated); its first admission is timed, with the
        prompt tokens it found in the prefix cache."""
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_cached_tokens
        self.running.append(request)

    def preempt(self, request: Request, to_front: bool = True) -> None:
        """The running request goes back in line (to its front under fcfs), keeping its tokens: its K/V are swapped
        out to the host tier (preemption_mode="swap", when the host tier has room and the request is not a beam) or
        dropped to be recomputed. The workers drop it; it is sent to them in full when it resumes."""
        self.running.remove(request)
        self.worker_view.forget(request.request_id)
        manager = self.kv_cache_manager
        if (self.config.preemption_mode == "swap" and request.beam_group is None
                and manager.can_swap_out(request)):
            manager.swap_out(request)
        else:
            self._drop_kv(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if to_front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def recompute_swapped(self, request_ids: Iterable[str]) -> None:
        """Those of these requests that are swapped out recompute instead (after a failed step, whose copies to the
        host tier may not have happened)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and self.kv_cache_manager.is_swapped_out(request):
                self._drop_kv(request)

    def _drop_kv(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.beam_candidates = None  # sampled again after the recompute
        request.pooled_data = None  # pooled again, from the first chunk

    def fork(self, parent: Request, children: list[Request]) -> None:
        """New sequences of the running `parent` (made by `Request.fork`) share its blocks and run right after it,
        in this order."""
        position = self.running.index(parent)
        for child in children:
            self.kv_cache_manager.fork(parent, child)
            self._track(child)
            position += 1
            self.running.insert(position, child)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """The live request leaves its queue and the engine: its blocks are freed and the workers drop it."""
        assert status.is_finished, status
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_FSM:
            self.waiting_for_fsm.remove(request)
        else:
            self.waiting.remove(request)
        self.worker_view.forget(request.request_id)
        request.status = status
        self.kv_cache_manager.free(request)
        self._finished_req_ids.append(request.request_id)
        del self.requests[request.request_id]
        members = self.groups[request.group_id]
        members.discard(request.request_id)
        if not members:
            del self.groups[request.group_id]

    def finish_groups(self, group_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish every live sequence of these groups (user request ids); returns them."""
        finished = [self.requests[request_id] for group_id in group_ids
                    for request_id in sorted(self.groups.get(group_id, ()))]
        for request in finished:
            self.finish(request, status)
        return finished

    def fail(self, errors: dict[str, str]) -> None:
        """Group id -> why it failed: finish every sequence of each group with FINISHED_ERROR (siblings too: the
        user asked for them together) and keep the reason for `take_failed_groups`."""
        for group_id, error in errors.items():
            self._failed_groups.setdefault(group_id, error)
            self.finish_groups([group_id], RequestStatus.FINISHED_ERROR)

    def _track(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.groups.setdefault(request.group_id, set()).add(request.request_id)

    # ---- what the transitions left behind ----------------------------------------------------------------
    def take_finished_req_ids(self) -> list[str]:
        finished, self._finished_req_ids = self._finished_req_ids, []
        return finished

    def take_failed_groups(self) -> dict[str, str]:
        failed, self._failed_groups = self._failed_groups, {}
        return failed

    # ---- queries -----------------------------------------------------------------------------------------
    def check_id_unused(self, request: Request) -> None:
        if request.group_id in self.groups or request.request_id in self.requests:
            raise InvalidRequestError(f"Request id {request.group_id!r} is already in use; give each request a "
                                      f"unique id.")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_fsm)

    def check_consistency(self) -> None:
        """Raise RuntimeError unless the queues hold exactly the live requests."""
        queues = (self.running, self.waiting, self.waiting_for_fsm)
        queued = {r.request_id for queue in queues for r in queue}
        if queued != set(self.requests) or len(queued) != sum(map(len, queues)):
            raise RuntimeError("The scheduler's queues disagree with its live requests.")
