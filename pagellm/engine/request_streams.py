"""AsyncLLM's live requests: each one's output queue, read by its consumer on that consumer's event loop, and how an
engine pass's CoreUpdate, which arrives on the client's thread, becomes outputs in those queues: handed to each
consumer's loop once per pass with `loop.call_soon_threadsafe`, then detokenized there by the front end and
timestamped for metrics. A request's queue ends with its finished output, an exception, or `Aborted`."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagellm.beam_search import BeamSearchOutput
from pagellm.engine.async_stats import FrontendStats, record_beam_search
from pagellm.engine.core_client import EngineCoreClient
from pagellm.engine.core_output import CoreUpdate, EngineCoreOutput
from pagellm.engine.frontend import EngineFrontend
from pagellm.exceptions import EngineDeadError, InvalidRequestError, request_failure
from pagellm.metrics.stats import IterationStats, RequestStateStats


class Aborted:
    """Sent to a request's queue when it is aborted: its generate() ends without a finished output."""


@dataclass(eq=False)
class RequestStream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # of RequestOutput | BeamSearchOutput | Aborted | BaseException
    stats: RequestStateStats
    engine_index: int = 0  # the engine core (data-parallel replica) that runs it


class RequestStreams:
    """The streams of the requests in flight, by id. Opened, dropped and filled on the event loops; the client's
    threads only read the registry (`on_update`, `fail_all`) and hand work to the loops."""

    def __init__(self, client: EngineCoreClient, frontend: EngineFrontend, stats: FrontendStats) -> None:
        self.client = client
        self.frontend = frontend
        self.stats = stats
        self._streams: dict[str, RequestStream] = {}

    # ---- the event loops -------------------------------------------------------------------------------------
    def check_unused(self, request_id: str) -> None:
        if request_id in self._streams:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.")

    def open(self, request_id: str, arrival: float) -> RequestStream:
        stream = RequestStream(request_id, asyncio.get_running_loop(), asyncio.Queue(),
                               RequestStateStats(arrival_time=arrival))
        self._streams[request_id] = stream
        return stream

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.frontend.abort([request_id])

    def abort(self, request_id: str) -> None:
        """End the request's stream (if open) with Aborted."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self.drop(request_id)
            stream.queue.put_nowait(Aborted())

    def _process_core_outputs(self, engine_index: int, outputs: list[EngineCoreOutput], failed: dict[str, str],
                              beam_searches: dict[str, BeamSearchOutput]) -> None:
        """On the event loop: detokenize one engine pass's outputs, report stop-string finishes to the engine,
        timestamp and queue each request's RequestOutput (and each finished beam search's result), then record
        their stats. Requests that failed (in the core, or here while building their output) end with
        RequestFailedError, or InvalidRequestError when the request itself was at fault."""
        processed = self.frontend.output_processor.process_outputs(outputs, delta=True)
        if processed.stopped:
            self.client.call_utility(engine_index, "finish_stopped", processed.stopped)  # the engine logs a failure
        if processed.failed:  # the core still runs these: free their blocks
            self.client.abort_requests(list(processed.failed))
        failures = IterationStats(engine_index=engine_index)
        for request_id, error in (failed | processed.failed).items():
            stream = self._streams.get(request_id)
            if stream is not None:
                self.drop(request_id)
                stream.queue.put_nowait(request_failure(request_id, error))
                failures.finished_requests.append(stream.stats.finished("error", time.monotonic()))
        if failures.finished_requests:
            self.stats.record(failures)
        for core_output in outputs:
            stream = self._streams.get(core_output.group_id)
            if stream is not None and stream.stats.first_scheduled_time is None:
                stream.stats.first_scheduled_time = core_output.first_scheduled_time
        now = time.monotonic()
        iteration = IterationStats(engine_index=engine_index)
        for output in processed.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.stats.update(output, now, iteration)
            stream.queue.put_nowait(output)
        for request_id, result in beam_searches.items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                beams = self.frontend.finish_beam_search(request_id, result)
                record_beam_search(stream.stats, beams, now, iteration)
                stream.queue.put_nowait(beams)
        self.stats.record(iteration)

    def _fail(self, request_ids: Iterable[str] | None, error: BaseException) -> None:
        """On the event loop: end these requests' streams (all of this loop's when None) with `error`."""
        for request_id in list(self._streams) if request_ids is None else request_ids:
            stream = self._streams.get(request_id)
            if stream is not None and stream.loop is asyncio.get_running_loop():
                self.drop(request_id)
                stream.queue.put_nowait(error)

    # ---- the client's threads ---------------------------------------------------------------------------------
    def on_update(self, engine_index: int, update: CoreUpdate) -> None:
        """Hand one engine pass's outputs and refusals to the event loops of their consumers (one wake-up of each
        loop per pass)."""
        self.stats.observe(engine_index, update.stats)  # before the outputs: a finished request is not counted
        batches: dict[asyncio.AbstractEventLoop,
                      tuple[list[EngineCoreOutput], dict[str, str], dict[str, BeamSearchOutput]]] = {}
        for output in update.outputs.outputs:
            stream = self._streams.get(output.group_id)
            if stream is not None:
                batches.setdefault(stream.loop, ([], {}, {}))[0].append(output)
        for request_id, error in update.outputs.failed.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                batches.setdefault(stream.loop, ([], {}, {}))[1][request_id] = error
        for request_id, result in update.outputs.finished_beam_searches.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                batches.setdefault(stream.loop, ([], {}, {}))[2][request_id] = result
        for loop, (items, failed, beam_searches) in batches.items():
            self._call_soon(loop, self._process_core_outputs, engine_index, items, failed, beam_searches)
        for request_id, error in update.refused.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                self._call_soon(stream.loop, self._fail, [request_id], error)

    def fail_all(self, reason: str) -> None:
        """End every request's stream with EngineDeadError(reason), on its own event loop."""
        for loop in {stream.loop for stream in list(self._streams.values())}:
            self._call_soon(loop, self._fail, None, EngineDeadError(reason))

    def _call_soon(self, loop: asyncio.AbstractEventLoop, callback, *args) -> None:
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the consumers' event loop is closed: nobody will read these requests any more
            orphans = [r for r, stream in list(self._streams.items()) if stream.loop is loop]
            for request_id in orphans:
                self._streams.pop(request_id, None)
            self.client.abort_requests(orphans)
