"""Continuous batching under a token budget, with chunked prefill and recompute preemption.

There are no prefill or decode phases: every request has `num_computed_tokens`, and each step the scheduler
hands out tokens (running requests first, then waiting ones in arrival order) until the budget
`max_num_batched_tokens` or `max_num_seqs` is reached. A prompt longer than the remaining budget is split
into chunks (when chunked prefill is on), so decodes never stall behind it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import ScheduledRequest, SchedulerOutput
from pagellm.engine.request import Request, RequestStatus


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self._finished_req_ids: list[str] = []
        self.num_preemptions_total = 0

    # ---- request lifecycle -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

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
            else:
                self.waiting.remove(request)
            if stop_reasons and request_id in stop_reasons:
                request.stop_reason = stop_reasons[request_id]
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv_cache_manager.usage,
                              self.num_preemptions_total)

    # ---- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        token_budget = self.config.max_num_batched_tokens

        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while not self.kv_cache_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            output.scheduled.append(self._schedule(request, num_new))
            token_budget -= num_new
            index += 1

        # Admitting new work while preempting would only thrash the cache.
        while (self.waiting and not output.preempted_req_ids and token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > token_budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, token_budget)
            if not self.kv_cache_manager.allocate_slots(request, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(self._schedule(request, num_new))
            token_budget -= num_new
        return output

    def _schedule(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            sampling_params=request.sampling_params,
            needs_sample=end == request.num_tokens,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            bad_words_token_ids=request.bad_words_token_ids,
        )

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the K/V, keep the tokens, and go back to the front of the line."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # ---- results -----------------------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int], logprobs: dict | None = None,
                           prompt_logprobs: dict | None = None) -> tuple[list[Request], list[Request]]:
        """Advance every scheduled request; returns (requests that got a new token, requests that finished).

        `logprobs`: request id -> (ids, logprobs, ranks) of its sampled token (first) and top-k tokens.
        `prompt_logprobs`: request id -> (index of the first entry, entries) for this step's prompt chunk;
        entries a preempted request already has (recomputed prefill) are not appended again."""
        updated, finished = [], []
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += scheduled.num_tokens
            if prompt_logprobs and request.request_id in prompt_logprobs:
                first, entries = prompt_logprobs[request.request_id]
                have = len(request.prompt_logprobs)
                if first <= have:
                    request.prompt_logprobs.extend(entries[have - first:])
            if not scheduled.needs_sample:
                continue
            if logprobs and request.request_id in logprobs:
                entry = logprobs[request.request_id]
                request.logprobs.append(entry)
                request.cumulative_logprob += entry[1][0]
            request.append_output_token(sampled[request.request_id])
            updated.append(request)
            status = self._check_stop(request)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return updated, finished

    def _check_stop(self, request: Request) -> RequestStatus | None:
        token = request.output_token_ids[-1]
        params = request.sampling_params
        if not params.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        self._finished_req_ids.append(request.request_id)
        del self.requests[request.request_id]
