"""EngineCore: the step loop. Schedule, execute on the workers, update request state.

The step function is chosen once, at start, by how batches overlap (vLLM's `step_fn`): `_step_sync` runs one batch
at a time; `_step_pipelined` keeps one batch per pipeline stage in flight; `_step_async` schedules the next batch
while the current one runs (async scheduling). `step()` runs the chosen one.

Besides adding and aborting requests, what a client may ask of the core goes through one generic call:
`call_utility(name, *args)` runs a method marked `@utility` (the allow-list is those marks), whatever the client
(the offline engine, the engine thread, a replica process). A new command is one such method and its caller.

Failures stay as small as they can: a request whose own work fails (in the worker or while its results are
applied) fails alone with its group; a step that fails as a whole fails the requests it held, and the engine goes
on once the block accounting checks out. Only repeated whole-step failures, or accounting that no longer adds
up, raise out of `step()` (the engine is then dead)."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from pagellm.config import EngineConfig
from pagellm.core.beam_group import BeamGroup
from pagellm.core.kv.kv_cache_groups import kv_cache_groups
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.output import SchedulerOutput
from pagellm.core.sched.scheduler import Scheduler
from pagellm.core.state_snapshot import engine_state
from pagellm.engine.core_output import EngineCoreOutput, EngineCoreOutputs
from pagellm.engine.step_profile import profile_decode_steps
from pagellm.exceptions import EngineDeadError
from pagellm.executor.abstract import Executor
from pagellm.logger import init_logger
from pagellm.metrics.stats import StepTimings
from pagellm.model_executor.layers.attention import layer_windows
from pagellm.structured_output.manager import StructuredOutputManager

logger = init_logger(__name__)

MAX_CONSECUTIVE_FAILED_STEPS = 3
# With nothing to run but requests whose grammars compile, a step waits this long at most for one of them.
GRAMMAR_WAIT_S = 0.05

F = TypeVar("F", bound=Callable[..., Any])


def utility(method: F) -> F:
    """Mark an EngineCore method as one that clients may run by name through `EngineCore.call_utility`. Its
    arguments and result cross a process boundary with data-parallel replicas, so they must pickle."""
    method.engine_utility = True  # type: ignore[attr-defined]
    return method


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = Executor.create(config)
        self.num_blocks = self.executor.determine_num_blocks()
        num_host_blocks = self.executor.determine_num_host_blocks()
        self.executor.initialize_cache(self.num_blocks, num_host_blocks)
        cache_config = config.cache_config
        # One block table per KV cache group (layers of one attention type): sliding groups free what leaves the window.
        groups = kv_cache_groups(layer_windows(config.model_config.hf_config, config.model_config.num_layers))
        self.kv_cache_manager = KVCacheManager(self.num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching, num_host_blocks,
                                               group_windows=[group.window for group in groups])
        self.structured_output_manager = StructuredOutputManager(config.model_config,
                                                                 config.structured_outputs_config)
        self.scheduler = Scheduler(config.scheduler_config, config.model_config.max_model_len, self.kv_cache_manager,
                                   self.structured_output_manager)
        if config.scheduler_config.target_tpot_ms is not None and config.model_config.runner == "generate":
            profile_decode_steps(self.executor, self.scheduler, config.scheduler_config,
                                 config.model_config.max_model_len, self.num_blocks, cache_config.block_size,
                                 len(groups))
        self._consecutive_failed_steps = 0
        self.step_timings = StepTimings()
        self._in_flight: deque[SchedulerOutput] = deque()  # submitted batches, oldest first
        # Where the step collected next began, for the latency target's model of step time: the previous
        # collection while work went on (the time between steps counts, as users see it), else its scheduling.
        self._step_clock: float | None = None
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.num_stages = self.executor.max_concurrent_batches
        # Async scheduling keeps the next batch queued behind the running one (see core/sched/async_scheduling.py);
        # it needs the in-process executor, so it never meets a pipeline.
        self.max_in_flight = 2 if self.async_scheduling else self.num_stages
        # Async scheduling: the newest batch, submitted up to its sampling, whose constrained sequences wait for the
        # batch before it to be applied (their bitmask needs the grammars advanced by its tokens).
        self._sample_later: SchedulerOutput | None = None
        self.step_fn: Callable[[], EngineCoreOutputs] = (
            self._step_async if self.async_scheduling else self._step_pipelined if self.num_stages > 1
            else self._step_sync)

    # ---- requests (the hot path) --------------------------------------------------------------------------
    def add_request(self, request: Request, beam_group: BeamGroup | None = None) -> None:
        self.scheduler.add_request(request, beam_group)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str], status: RequestStatus,
                        stop_reasons: dict[str, int | str] | None = None) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, status, stop_reasons)

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    # ---- utilities: what clients call by name ---------------------------------------------------------------
    def call_utility(self, method: str, *args: Any) -> Any:
        """Run the `@utility` method `method` with `args`; anything else is refused with ValueError."""
        function = getattr(type(self), method, None)
        if not callable(function) or not getattr(function, "engine_utility", False):
            raise ValueError(f"{method!r} is not an engine utility.")
        return function(self, *args)

    @utility
    def finish_stopped(self, stop_reasons: dict[str, str]) -> None:
        """Finish the sequences a stop string ended (sequence id -> that stop string), freeing their blocks."""
        self.finish_requests(list(stop_reasons), RequestStatus.FINISHED_STOPPED, stop_reasons=dict(stop_reasons))

    @utility
    def engine_state(self) -> dict:
        """A JSON-able snapshot of the queues and KV block pools, for the dashboard (core/state_snapshot.py)."""
        return engine_state(self.scheduler)

    # ---- the step functions ---------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One pass of the step function chosen at start. Returns what is new for every sequence that got a token,
        and finished beam searches (nothing when a pass only submitted a batch)."""
        return self.step_fn()

    def _step_sync(self) -> EngineCoreOutputs:
        """One batch at a time: schedule it, run it, apply its results."""
        start = time.perf_counter()
        output = self._schedule(None, start)
        if output.is_empty:
            return self._idle()
        self._submit(output)
        return self._collect()

    def _step_pipelined(self) -> EngineCoreOutputs:
        """A batch per pipeline stage: submit one more while a stage is free (the requests split so that each stage
        has one to work on), else collect the oldest and apply its results."""
        start = time.perf_counter()
        if len(self._in_flight) < self.max_in_flight:
            output = self._schedule(-(-self.scheduler.num_unfinished // self.num_stages), start)
            if not output.is_empty:
                self._submit(output)
                if len(self._in_flight) < self.max_in_flight:
                    return EngineCoreOutputs()
        if not self._in_flight:
            return self._idle()
        return self._collect()

    def _step_async(self) -> EngineCoreOutputs:
        """Async scheduling: schedule and submit the next batch while the previous one runs (unless a request in
        flight must wait for its results), then collect the oldest batch; the first batch is only submitted."""
        start = time.perf_counter()
        if len(self._in_flight) < self.max_in_flight and (not self._in_flight
                                                           or self.scheduler.can_schedule_ahead()):
            output = self._schedule(None, start)
            if not output.is_empty:
                if self._in_flight and self.scheduler.needs_late_bitmask(output):
                    self.executor.submit_forward(output)
                    self._sample_later = output
                    self._in_flight.append(output)
                else:
                    self._submit(output)
                if len(self._in_flight) < self.max_in_flight:
                    return EngineCoreOutputs()
        if not self._in_flight:
            return self._idle()
        return self._collect()

    # ---- the parts of a step --------------------------------------------------------------------------------
    def _schedule(self, max_scheduled: int | None, start: float) -> SchedulerOutput:
        output = self.scheduler.schedule(max_scheduled)
        if self._step_clock is None:
            self._step_clock = start
        # Before submitting: an in-process executor runs the whole step inside submit_model, and the worker times
        # that itself (prepare_inputs, forward, sample).
        self.step_timings.add({"schedule": time.perf_counter() - start})
        return output

    def _submit(self, output: SchedulerOutput) -> None:
        # The constrained sequences' bitmask is computed while the workers run the forward pass; the rank that
        # samples waits for it only then (vLLM's split of execute_model and sample_tokens).
        self.executor.submit_model(output, self.scheduler.start_grammar_bitmask(output))
        self._in_flight.append(output)

    def _idle(self) -> EngineCoreOutputs:
        """Nothing was scheduled and nothing is in flight."""
        self._step_clock = None
        if self.scheduler.waiting_for_fsm:
            # Only requests whose grammars compile are left: wait for one instead of spinning.
            self.structured_output_manager.wait_for_any(
                [r.structured_output_request for r in self.scheduler.waiting_for_fsm], GRAMMAR_WAIT_S)
            return EngineCoreOutputs()
        if self.scheduler.has_unfinished_requests():
            # Every admitted request fits the pool on its own, so this means a bookkeeping bug: fail, never hang.
            raise RuntimeError("The scheduler could not schedule any of the unfinished requests.")
        return EngineCoreOutputs()

    def _collect(self) -> EngineCoreOutputs:
        """Collect the oldest batch in flight and apply its results."""
        output = self._in_flight.popleft()
        try:
            result = self.executor.collect_model_output()
        except EngineDeadError:
            raise  # a worker is gone: nothing to recover
        except Exception as exc:
            self._recover_from_failed_step(output, exc)
            self._sample_late_batch()
            return EngineCoreOutputs(failed=self.scheduler.take_failed_groups())
        self._consecutive_failed_steps = 0
        collected = time.perf_counter()
        self.scheduler.observe_step_time(output, collected - (self._step_clock or collected))
        updated, _ = self.scheduler.update_from_output(output, result.sampled_token_ids, result.logprobs,
                                                       result.prompt_logprobs, result.failed, result.pooler_output,
                                                       result.draft_token_ids)
        self._step_clock = collected if self.scheduler.has_unfinished_requests() else None
        self._sample_late_batch()
        outputs = EngineCoreOutputs([self._snapshot(request) for request in updated],
                                    failed=self.scheduler.take_failed_groups())
        if outputs.failed:
            self.scheduler.check_consistency()
        for group in self.scheduler.take_finished_beam_groups():
            outputs.finished_beam_searches[group.request_id] = group.result()
        self.step_timings.num_steps += 1
        self.step_timings.add({"update": time.perf_counter() - collected, **result.phase_seconds})
        return outputs

    def _sample_late_batch(self) -> None:
        """The batch before the one waiting to sample is applied: its grammars have advanced, so the waiting one's
        bitmask can be computed and the batch sampled (before anything else is scheduled)."""
        if self._sample_later is not None:
            output, self._sample_later = self._sample_later, None
            self.executor.sample_submitted(self.scheduler.start_grammar_bitmask(output))

    def _recover_from_failed_step(self, output: SchedulerOutput, exc: Exception) -> None:
        """The step failed as a whole: fail the requests it held (their K/V may be half written) and check the
        block accounting before going on. Raises when too many steps failed in a row."""
        self._consecutive_failed_steps += 1
        logger.error("An engine step failed (%d in a row); its %d requests fail.", self._consecutive_failed_steps,
                     len(output.scheduled), exc_info=exc)
        if self._consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise RuntimeError(f"{self._consecutive_failed_steps} engine steps failed in a row.") from exc
        self.scheduler.recover_from_failed_step(output, f"{type(exc).__name__}: {exc}")
        self.scheduler.check_consistency()

    @staticmethod
    def _snapshot(request: Request) -> EngineCoreOutput:
        """The sequence's newest tokens (one per update, more when speculative decoding accepted drafts), with
        their logprobs; prompt logprobs go with the first token of the group's first sequence, when the whole prompt
        has been computed. A pooling request's one snapshot, when it finishes, carries its pooled vector instead."""
        params = request.sampling_params
        first_token = request.num_output_tokens == 1 and request.index == 0
        return EngineCoreOutput(
            request_id=request.request_id, group_id=request.group_id, index=request.index,
            new_token_ids=request.output_token_ids[-request.num_step_tokens:],
            new_logprobs=request.logprobs[-request.num_step_tokens:] if params.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs) if first_token and params.prompt_logprobs is not None
            else None,
            finish_reason=request.finish_reason if request.is_finished else None,
            stop_reason=request.stop_reason if request.is_finished else None,
            first_scheduled_time=request.first_scheduled_time, num_cached_tokens=request.num_cached_tokens,
            pooled_data=request.pooled_data if request.is_finished else None)
