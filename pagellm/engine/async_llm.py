"""AsyncLLM: the engine behind the server, driven from asyncio, split like vLLM v1's API server and engine core.

The engine core runs apart: on a thread of this process (InprocClient), or as `--data-parallel-size` replicas in
processes of their own (DPClient); see core_client.py. It only schedules, runs forward passes and samples.
Everything else stays on the event loop, in the front end it shares with the offline engine (EngineFrontend:
tokenization and validation, detokenization, stop strings, RequestOutputs, beam search results), with timing for
metrics. Requests and aborts go to the client, and any other command as a utility call (`call_utility`: finishing
sequences a stop string ended, the dashboard's state snapshot); each engine pass's CoreUpdate comes back on the
client's thread and is handed to the event loop of each request's consumer with `loop.call_soon_threadsafe`
(request_streams.py: the requests' output queues and that hand-off; this module: the API and its lifecycle). The
model therefore never waits for text processing, and a busy HTTP side only delays its own outputs. Torch releases
the GIL in its kernels, so both sides make progress on one process.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import Future
from contextlib import aclosing
from typing import Any

from pagellm.beam_search import BeamSearchOutput
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_stats import FrontendStats
from pagellm.engine.core import EngineCore
from pagellm.engine.core_client import EngineCoreClient, InprocClient
from pagellm.engine.core_loop import resolve_future
from pagellm.engine.frontend import EngineFrontend
from pagellm.engine.input_processor import PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.request_streams import Aborted, RequestStream, RequestStreams
from pagellm.exceptions import EngineDeadError, InvalidRequestError
from pagellm.logger import init_logger
from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase
from pagellm.outputs import PoolingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import BeamSearchParams, SamplingParams

logger = init_logger(__name__)


class AsyncLLM:
    def __init__(self, client: EngineCoreClient, frontend: EngineFrontend, max_waiting_requests: int | None = None,
                 log_stats: bool = True) -> None:
        self.client = client
        # Used on the event loop only from here on (the core runs on the client's threads or processes).
        self.frontend = frontend
        self.config = frontend.config
        self.max_waiting_requests = max_waiting_requests
        self.stats = FrontendStats(client.initial_stats(), log_stats)
        self._streams = RequestStreams(client, frontend, self.stats)
        self._utility_calls: set[Future] = set()  # call_utility() calls being answered
        self._stopped_reason: str | None = None
        client.start(self._streams.on_update, self._on_dead)

    @classmethod
    def from_engine(cls, engine: LLMEngine, max_waiting_requests: int | None = None,
                    log_stats: bool = True) -> AsyncLLM:
        """Serve with this engine's core, stepped by a thread of this process, and its front end."""
        _check_max_waiting_requests(max_waiting_requests)
        return cls(InprocClient(lambda: engine.engine_core, max_waiting_requests), engine.frontend,
                   max_waiting_requests, log_stats)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_waiting_requests: int | None = None,
                         log_stats: bool = True) -> AsyncLLM:
        _check_max_waiting_requests(max_waiting_requests)
        config = args.create_engine_config()
        client: EngineCoreClient
        if config.parallel_config.data_parallel_size == 1:
            client = InprocClient(lambda: EngineCore(config), max_waiting_requests)
        else:
            from pagellm.engine.dp_client import DPClient

            client = DPClient(config, max_waiting_requests)
        try:
            frontend = EngineFrontend(config, client.num_blocks)
        except BaseException:
            client.shutdown()
            raise
        return cls(client, frontend, max_waiting_requests, log_stats)

    # ---- the asyncio side -----------------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as deltas (new text, token ids and logprobs of each CompletionOutput since
        the previous yield); the last has `finished=True`. `priority`: lower runs first, with --scheduling-policy
        priority. Bad input raises InvalidRequestError and a full waiting queue QueueFullError, both before
        anything is yielded. Leaving the iteration early aborts the request."""
        self._check_alive()
        arrival = time.monotonic()
        if isinstance(sampling_params, SamplingParams) and sampling_params.structured_outputs is not None:
            await asyncio.to_thread(self.frontend.input_processor.validate_structured_outputs,
                                    sampling_params.structured_outputs)
        async with aclosing(self._submit(prompt, sampling_params, request_id, priority, arrival)) as outputs:
            async for output in outputs:
                yield output

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request (vLLM's name): its prompt is prefilled, in the same batches as generations, and one
        PoolingRequestOutput is yielded when it is done. Errors and aborts as in generate()."""
        self._check_alive()
        async with aclosing(self._submit(prompt, pooling_params, request_id, priority, time.monotonic())) as outputs:
            async for output in outputs:
                yield output

    async def _submit(self, prompt: PromptType, params: SamplingParams | PoolingParams, request_id: str,
                      priority: int, arrival: float) -> AsyncGenerator[Any, None]:
        """Validate and queue a request, then its outputs (see `_stream_outputs`)."""
        request = self.frontend.process(request_id, prompt, params, priority)
        self._streams.check_unused(request_id)
        stream = self._streams.open(request_id, arrival)
        self.frontend.track(request)
        stream.engine_index = self.client.add_request(request)
        async with aclosing(self._stream_outputs(stream)) as outputs:
            async for output in outputs:
                yield output

    async def beam_search(self, prompt: PromptType, params: BeamSearchParams,
                          request_id: str) -> AsyncIterator[BeamSearchOutput]:
        """The beam search LLM.beam_search runs (beams inside the engine, sharing KV blocks), as a request of its
        own: yields one BeamSearchOutput, beams best first, when it finishes. Errors and aborts as in generate()."""
        self._check_alive()
        self._streams.check_unused(request_id)  # first: the front end keys a beam search's prompt length by its id
        arrival = time.monotonic()
        request, group = self.frontend.process_beam_search(request_id, prompt, params)
        stream = self._streams.open(request_id, arrival)
        stream.stats.num_prompt_tokens = request.num_prompt_tokens
        stream.engine_index = self.client.add_request(request, group)
        async with aclosing(self._stream_outputs(stream)) as outputs:
            async for output in outputs:
                yield output

    def _check_alive(self) -> None:
        if self._stopped_reason is not None:
            raise EngineDeadError(self._stopped_reason)

    async def _stream_outputs(self, stream: RequestStream) -> AsyncGenerator[Any, None]:
        """A queued request's outputs until its last one; leaving early aborts it."""
        request_id = stream.request_id
        if self._stopped_reason is not None:  # checked after queueing: a dying engine may have missed it
            self._streams.drop(request_id)
            raise EngineDeadError(self._stopped_reason)
        done = False
        try:
            while not done:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, Aborted):
                    return
                done = isinstance(item, BeamSearchOutput) or item.finished
                yield item
        finally:
            self._streams.drop(request_id)
            if not done:
                # The consumer went away (client disconnect, cancellation) or abort() was called: free the blocks.
                self.client.abort_requests([request_id])
                aborted = stream.stats.finished("abort", time.monotonic())
                self.stats.record(IterationStats(finished_requests=[aborted], engine_index=stream.engine_index))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its generate() iteration ends. Unknown or finished ids are ignored."""
        self._streams.abort(request_id)
        self.client.abort_requests([request_id])

    def shutdown(self) -> None:
        """Abort every request in flight (each consumer gets EngineDeadError) and stop the engine cores."""
        self._on_dead("The server is shutting down.")
        self.client.shutdown()

    @property
    def is_running(self) -> bool:
        return self._stopped_reason is None

    def max_requests_at_once(self, prompt_lens: list[int], n: int) -> int | None:
        """How many requests with these prompt lengths (in order, n sequences each) can be running or waiting at
        once (None: no limit): those idle engines admit, plus `max_waiting_requests` (per engine). A batch of
        more could never be queued, so it is refused rather than told to retry."""
        if self.max_waiting_requests is None:
            return None
        return (self.client.num_fitting([(n, length) for length in prompt_lens])
                + self.max_waiting_requests * self.client.num_engines)

    def get_scheduler_stats(self) -> SchedulerStats:
        """All engines' latest snapshots, summed."""
        return self.stats.scheduler_stats()

    def get_replica_scheduler_stats(self) -> list[SchedulerStats]:
        """Each engine's (data-parallel replica's) latest snapshot, by engine index."""
        return list(self.stats.replica_stats)

    def check_engine_index(self, engine_index: int) -> int:
        """`engine_index` if it names one of the engines (data-parallel replicas), else InvalidRequestError."""
        if not 0 <= engine_index < self.client.num_engines:
            raise InvalidRequestError(f"engine must be between 0 and {self.client.num_engines - 1}, the engine "
                                      f"replicas (--data-parallel-size); got {engine_index}.")
        return engine_index

    async def get_engine_state(self, engine_index: int = 0) -> dict:
        """A JSON-able snapshot of one engine's queues and KV block pools (see core/state_snapshot.py), taken by its
        loop between two steps: the scheduler and the block pools are not thread-safe."""
        return await self.call_utility("engine_state", engine_index=engine_index)

    async def call_utility(self, method: str, *args: Any, engine_index: int = 0) -> Any:
        """Run the `@utility` method `method` of one engine core (engine/core.py) between two of its steps; its
        result, or the exception it raised (EngineDeadError when the engine stops first)."""
        self.check_engine_index(engine_index)
        self._check_alive()
        future = self.client.call_utility(engine_index, method, *args)
        self._utility_calls.add(future)
        try:
            if self._stopped_reason is not None:  # checked after asking: a dying engine may never answer
                raise EngineDeadError(self._stopped_reason)
            return await asyncio.wrap_future(future)
        finally:
            self._utility_calls.discard(future)

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        self.stats.stat_loggers.append(stat_logger)

    def do_log_stats(self) -> None:
        self.stats.log()

    # ---- the client's threads ---------------------------------------------------------------------------------
    def _on_dead(self, reason: str) -> None:
        """An engine can no longer run (or the server is shutting down): fail every request in flight with
        EngineDeadError(reason). Only the first call counts."""
        if self._stopped_reason is not None:
            return
        self._stopped_reason = reason  # first: generate() checks it after queueing, so nothing queued is missed
        self._streams.fail_all(reason)
        for future in list(self._utility_calls):
            resolve_future(future, False, EngineDeadError(reason))


def _check_max_waiting_requests(max_waiting_requests: int | None) -> None:
    if max_waiting_requests is not None and max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be at least 1, got {max_waiting_requests}.")
