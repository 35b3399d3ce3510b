"""AsyncLLM: the engine behind the server, driven from asyncio, split like vLLM v1's API server and engine core.

A background thread runs only the EngineCore step loop (schedule, forward pass, sample). Everything else stays on
the event loop: tokenization and validation (InputProcessor), detokenization, stop strings and RequestOutputs
(OutputProcessor), and timing for metrics. The two sides talk through a thread-safe inbox that the engine thread
drains between steps (and sleeps on while idle): new requests, aborts, and sequences a stop string ended; and,
the other way, each step's EngineCoreOutputs handed to the event loop with `loop.call_soon_threadsafe`. The model
therefore never waits for text processing, and a busy HTTP side only delays its own outputs. Torch releases the
GIL in its kernels, so both sides make progress on one process.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagellm.config import EngineConfig
from pagellm.core.request import Request, RequestStatus
from pagellm.core.state_snapshot import engine_state
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_output import EngineCoreOutput, EngineCoreOutputs
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.output_processor import OutputProcessor
from pagellm.exceptions import EngineDeadError, InvalidRequestError, QueueFullError, RequestFailedError
from pagellm.logger import init_logger
from pagellm.metrics.loggers import LoggingStatLogger
from pagellm.metrics.stats import IterationStats, RequestStateStats, SchedulerStats, StatLoggerBase
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.transformers_utils.tokenizer import get_tokenizer

logger = init_logger(__name__)


class _Aborted:
    """Sent to a request's queue when it is aborted: its generate() ends without a finished output."""


@dataclass(eq=False)
class _RequestStream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # of RequestOutput | _Aborted | BaseException
    stats: RequestStateStats


@dataclass
class _AddRequest:
    request: Request
    loop: asyncio.AbstractEventLoop


@dataclass
class _AbortRequest:
    request_id: str


@dataclass
class _FinishStopped:
    stop_reasons: dict[str, str]  # sequence id -> the stop string that ended it


@dataclass
class _StateRequest:
    """Asks the engine thread for a snapshot of its queues and KV pools (core/state_snapshot.py)."""

    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def _settle(future: asyncio.Future, result: dict | BaseException) -> None:
    if not future.done():  # the asking coroutine may have been cancelled meanwhile
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


@dataclass
class _ExecutorFailed:
    reason: str


_SHUTDOWN = object()
_Item = RequestOutput | _Aborted | BaseException


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None, log_stats: bool = True) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {max_waiting_requests}.")
        self.engine = engine
        self.core = engine.engine_core  # touched only by the engine thread once that runs
        self.config: EngineConfig = engine.config
        # The event loop's own tokenizer (a Hugging Face fast tokenizer must not be shared across threads).
        self.tokenizer = get_tokenizer(self.config.model_config.tokenizer)
        self.input_processor = InputProcessor(self.config, self.core.num_blocks, self.tokenizer,
                                              engine.input_processor.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers: list[StatLoggerBase] = [LoggingStatLogger(self.get_scheduler_stats)] if log_stats else []
        self._scheduler_stats = self.core.scheduler.stats()  # the engine thread's latest snapshot
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _RequestStream] = {}  # event loop only: live requests
        self._request_loops: dict[str, asyncio.AbstractEventLoop] = {}  # engine thread only
        self._stopped_reason: str | None = None
        self._thread = threading.Thread(target=self._run_engine_loop, name="pagellm-engine", daemon=True)
        # A worker that dies wakes the engine thread even when it is idle, so /health turns 503 at once.
        self.core.executor.on_failure(lambda reason: self._inbox.put(_ExecutorFailed(reason)))
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_waiting_requests: int | None = None,
                         log_stats: bool = True) -> AsyncLLM:
        return cls(LLMEngine.from_engine_args(args), max_waiting_requests, log_stats)

    # ---- the asyncio side -----------------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as deltas (new text, token ids and logprobs of each CompletionOutput since
        the previous yield); the last has `finished=True`. `priority`: lower runs first, with --scheduling-policy
        priority. Bad input raises InvalidRequestError and a full waiting queue QueueFullError, both before
        anything is yielded. Leaving the iteration early aborts the request."""
        if self._stopped_reason is not None:
            raise EngineDeadError(self._stopped_reason)
        arrival = time.monotonic()
        request = self.input_processor.process(request_id, prompt, sampling_params, priority)
        if request_id in self._streams:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.")
        loop = asyncio.get_running_loop()
        stream = _RequestStream(request_id, loop, asyncio.Queue(), RequestStateStats(arrival_time=arrival))
        self._streams[request_id] = stream
        self.output_processor.add_request(request)
        self._inbox.put(_AddRequest(request, loop))
        if self._stopped_reason is not None:  # checked after the put: a stopping thread drains the inbox later
            self._drop(request_id)
            raise EngineDeadError(self._stopped_reason)
        done = False
        try:
            while not done:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, _Aborted):
                    return
                done = item.finished
                yield item
        finally:
            self._drop(request_id)
            if not done:
                # The consumer went away (client disconnect, cancellation) or abort() was called: free the blocks.
                self._inbox.put(_AbortRequest(request_id))
                self._record(IterationStats(finished_requests=[stream.stats.finished("abort", time.monotonic())]))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its generate() iteration ends. Unknown or finished ids are ignored."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._drop(request_id)
            stream.queue.put_nowait(_Aborted())
        self._inbox.put(_AbortRequest(request_id))

    def _drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.output_processor.abort_requests([request_id])

    def shutdown(self) -> None:
        """Abort every request in flight (each consumer gets EngineDeadError) and stop the engine thread."""
        if self._thread.is_alive():
            self._inbox.put(_SHUTDOWN)
            self._thread.join()
        self.core.shutdown()

    @property
    def is_running(self) -> bool:
        return self._stopped_reason is None and self._thread.is_alive()

    def max_requests_at_once(self, prompt_lens: list[int], n: int) -> int | None:
        """How many requests with these prompt lengths (in order, n sequences each) can be running or waiting at
        once (None: no limit): those an idle engine admits, plus `max_waiting_requests`. A batch of more could
        never be queued, so it is refused rather than told to retry."""
        if self.max_waiting_requests is None:
            return None
        return self.core.scheduler.num_fitting([(n, length) for length in prompt_lens]) + self.max_waiting_requests

    def get_scheduler_stats(self) -> SchedulerStats:
        return self._scheduler_stats

    async def get_engine_state(self) -> dict:
        """A JSON-able snapshot of the queues and KV block pools (see core/state_snapshot.py), taken on the engine
        thread between two steps: the scheduler and the block pools are not thread-safe."""
        if self._stopped_reason is not None:
            raise EngineDeadError(self._stopped_reason)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_StateRequest(future, loop))
        if self._stopped_reason is not None:  # checked after the put: a stopping thread drains the inbox later
            raise EngineDeadError(self._stopped_reason)
        return await future

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        self.stat_loggers.append(stat_logger)

    def do_log_stats(self) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.log()

    def _process_core_outputs(self, outputs: list[EngineCoreOutput], failed: dict[str, str]) -> None:
        """On the event loop: detokenize one step's outputs, report stop-string finishes to the engine thread,
        timestamp and queue each request's RequestOutput, then record their stats. Requests that failed (in the
        core, or here while building their output) end with RequestFailedError."""
        processed = self.output_processor.process_outputs(outputs, delta=True)
        if processed.stopped:
            self._inbox.put(_FinishStopped(processed.stopped))
        for request_id in processed.failed:  # the core still runs these: free their blocks
            self._inbox.put(_AbortRequest(request_id))
        failures = IterationStats()
        for request_id, error in (failed | processed.failed).items():
            stream = self._streams.get(request_id)
            if stream is not None:
                self._drop(request_id)
                stream.queue.put_nowait(RequestFailedError({request_id: error}))
                failures.finished_requests.append(stream.stats.finished("error", time.monotonic()))
        if failures.finished_requests:
            self._record(failures)
        for output in outputs:
            stream = self._streams.get(output.group_id)
            if stream is not None and stream.stats.first_scheduled_time is None:
                stream.stats.first_scheduled_time = output.first_scheduled_time
        now = time.monotonic()
        iteration = IterationStats()
        for output in processed.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.stats.update(output, now, iteration)
            stream.queue.put_nowait(output)
        self._record(iteration)

    def _fail(self, request_ids: list[str] | None, error: BaseException) -> None:
        """On the event loop: end these requests' streams (all of this loop's when None) with `error`."""
        for request_id in list(self._streams) if request_ids is None else request_ids:
            stream = self._streams.get(request_id)
            if stream is not None and stream.loop is asyncio.get_running_loop():
                self._drop(request_id)
                stream.queue.put_nowait(error)

    def _record(self, iteration: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(iteration)

    # ---- the engine thread ----------------------------------------------------------------------------------
    def _run_engine_loop(self) -> None:
        reason = "The server is shutting down."
        try:
            while self._process_inbox(block=not self.core.has_unfinished_requests()):
                outputs = self.core.step() if self.core.has_unfinished_requests() else EngineCoreOutputs()
                # Before the outputs reach their consumers, so a finished request is never still counted.
                self._scheduler_stats = self.core.scheduler.stats()
                self._send_outputs(outputs)
        except EngineDeadError as exc:
            logger.error("The engine stopped: %s", exc)
            reason = f"The engine stopped: {exc}"
        except Exception:
            logger.exception("The engine loop failed; every pending request gets an error.")
            reason = "The engine stopped after an internal error; see the server log."
        self._stop(reason)

    def _process_inbox(self, block: bool) -> bool:
        """Apply the queued adds, aborts and stop-string finishes and answer state snapshots, waiting for one if
        `block`. False once shutdown is asked for."""
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while item is not _SHUTDOWN:
            if isinstance(item, _AddRequest):
                self._add(item)
            elif isinstance(item, _ExecutorFailed):
                raise EngineDeadError(item.reason)
            elif isinstance(item, _StateRequest):
                self._answer_state(item)
            elif isinstance(item, _FinishStopped):
                self.core.finish_requests(list(item.stop_reasons), RequestStatus.FINISHED_STOPPED,
                                          stop_reasons=dict(item.stop_reasons))
            else:
                self.core.abort_requests([item.request_id])
                self._request_loops.pop(item.request_id, None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _answer_state(self, item: _StateRequest) -> None:
        try:
            state: dict | BaseException = engine_state(self.core.scheduler)
        except Exception as exc:  # a dashboard must never stop the engine
            logger.exception("Could not take a snapshot of the engine state.")
            state = exc
        self._call_soon(item.loop, _settle, item.future, state)

    def _add(self, item: _AddRequest) -> None:
        request_id = item.request.request_id
        try:
            if self.max_waiting_requests is not None:
                waiting = self.core.scheduler.num_waiting_for_capacity()
                if waiting >= self.max_waiting_requests:
                    raise QueueFullError(f"{waiting} requests are already waiting for capacity "
                                         f"(--max-waiting-requests); retry later.")
            self.core.add_request(item.request)
        except Exception as exc:  # refused: fails this request only
            self._call_soon(item.loop, self._fail, [request_id], exc)
            return
        self._request_loops[request_id] = item.loop

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        batches: dict[asyncio.AbstractEventLoop, tuple[list[EngineCoreOutput], dict[str, str]]] = {}
        for output in outputs.outputs:
            loop = self._request_loops.get(output.group_id)
            if loop is not None:
                batches.setdefault(loop, ([], {}))[0].append(output)
        for request_id, error in outputs.failed.items():
            loop = self._request_loops.get(request_id)
            if loop is not None:
                batches.setdefault(loop, ([], {}))[1][request_id] = error
        for loop, (items, failed) in batches.items():  # one wake-up of each event loop per step
            self._call_soon(loop, self._process_core_outputs, items, failed)
        groups = self.core.scheduler.groups
        for request_id in [r for r in self._request_loops if r not in groups]:  # finished in the core
            del self._request_loops[request_id]

    def _call_soon(self, loop: asyncio.AbstractEventLoop, callback, *args) -> None:
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the consumers' event loop is closed: nobody will read these requests any more
            orphans = [r for r, owner in self._request_loops.items() if owner is loop]
            for request_id in orphans:
                del self._request_loops[request_id]
            self.core.abort_requests(orphans)

    def _stop(self, reason: str) -> None:
        """Fail every request in flight or still queued with EngineDeadError(reason)."""
        self._stopped_reason = reason  # first: generate() checks it after queueing, so nothing queued is missed
        loops = set(self._request_loops.values())
        try:
            self.core.abort_requests(list(self._request_loops))
            self._scheduler_stats = self.core.scheduler.stats()
        except Exception:
            logger.exception("Could not abort the requests in flight.")
        self._request_loops.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _AddRequest):
                loops.add(item.loop)
            elif isinstance(item, _StateRequest):
                self._call_soon(item.loop, _settle, item.future, EngineDeadError(reason))
        for loop in loops:
            self._call_soon(loop, self._fail, None, EngineDeadError(reason))
