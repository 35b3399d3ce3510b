"""EngineCoreLoop: one EngineCore stepped by a thread of its own, fed through an inbox.

The loop owns the core: nothing else touches the scheduler or the executor once it runs. Other threads (the server's
event loop, or a replica process's pipe reader) queue commands (add, abort, finish after a stop string, a state
snapshot for the dashboard, shutdown); the loop applies them between steps, sleeps on the inbox while idle, and
after every pass publishes a CoreUpdate: the step's outputs, the requests it refused, the requests that left the
core, and a scheduler snapshot. When the core can no longer run (a worker died, the step raised), `on_dead(reason)`
is called once after every request has been aborted.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.core.request import Request, RequestStatus
from pagellm.core.state_snapshot import engine_state
from pagellm.engine.core import EngineCore
from pagellm.engine.core_output import CoreUpdate, EngineCoreOutputs
from pagellm.exceptions import EngineDeadError, QueueFullError
from pagellm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _FinishStopped:
    stop_reasons: dict[str, str]  # sequence id -> the stop string that ended it


@dataclass
class _StateRequest:
    reply: StateCallback


@dataclass
class _ExecutorFailed:
    reason: str


_SHUTDOWN = object()
StateCallback = Callable[[dict | BaseException], None]


class EngineCoreLoop:
    def __init__(self, core: EngineCore, publish: Callable[[CoreUpdate], None], on_dead: Callable[[str], None],
                 max_waiting_requests: int | None = None) -> None:
        self.core = core
        self._publish = publish
        self._on_dead = on_dead
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # requests in the core, by request (group) id
        self._refused: dict[str, BaseException] = {}
        # A worker that dies wakes the loop even when it is idle, so /health turns 503 at once.
        core.executor.on_failure(lambda reason: self._inbox.put(_ExecutorFailed(reason)))
        self._thread = threading.Thread(target=self._run, name="pagellm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ---- commands (any thread) --------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._inbox.put(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._inbox.put(_Abort(request_ids))

    def finish_stopped(self, stop_reasons: dict[str, str]) -> None:
        self._inbox.put(_FinishStopped(stop_reasons))

    def request_state(self, reply: StateCallback) -> None:
        """Have `reply` called on the loop's thread with the engine state snapshot (core/state_snapshot.py), or
        with the exception that taking it raised."""
        self._inbox.put(_StateRequest(reply))

    def shutdown(self) -> None:
        """Stop the loop (requests in flight are aborted) and the core's workers."""
        if self._thread.is_alive():
            self._inbox.put(_SHUTDOWN)
            self._thread.join()
        self.core.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the loop's thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        reason = "The server is shutting down."
        try:
            while self._process_inbox(block=not self.core.has_unfinished_requests()):
                outputs = self.core.step() if self.core.has_unfinished_requests() else EngineCoreOutputs()
                groups = self.core.scheduler.groups
                left = [request_id for request_id in self._live if request_id not in groups]
                self._live.difference_update(left)
                refused, self._refused = self._refused, {}
                # The snapshot goes with the outputs, so a finished request is never still counted.
                self._publish(CoreUpdate(outputs, refused, left, self.core.scheduler.stats()))
        except EngineDeadError as exc:
            logger.error("The engine stopped: %s", exc)
            reason = f"The engine stopped: {exc}"
        except Exception:
            logger.exception("The engine loop failed; every pending request gets an error.")
            reason = "The engine stopped after an internal error; see the server log."
        self._stop(reason)

    def _process_inbox(self, block: bool) -> bool:
        """Apply the queued commands, waiting for one if `block`. False once shutdown is asked for."""
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while item is not _SHUTDOWN:
            if isinstance(item, Request):
                self._add(item)
            elif isinstance(item, _ExecutorFailed):
                raise EngineDeadError(item.reason)
            elif isinstance(item, _StateRequest):
                self._answer_state(item.reply)
            elif isinstance(item, _FinishStopped):
                self.core.finish_requests(list(item.stop_reasons), RequestStatus.FINISHED_STOPPED,
                                          stop_reasons=dict(item.stop_reasons))
            else:
                self.core.abort_requests(item.request_ids)
                self._live.difference_update(item.request_ids)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _answer_state(self, reply: StateCallback) -> None:
        try:
            state: dict | BaseException = engine_state(self.core.scheduler)
        except Exception as exc:  # a dashboard must never stop the engine
            logger.exception("Could not take a snapshot of the engine state.")
            state = exc
        reply(state)

    def _add(self, request: Request) -> None:
        try:
            if self.max_waiting_requests is not None:
                waiting = self.core.scheduler.num_waiting_for_capacity()
                if waiting >= self.max_waiting_requests:
                    raise QueueFullError(f"{waiting} requests are already waiting for capacity "
                                         f"(--max-waiting-requests); retry later.")
            self.core.add_request(request)
        except Exception as exc:  # refused: fails this request only
            self._refused[request.request_id] = exc
            return
        self._live.add(request.request_id)

    def _stop(self, reason: str) -> None:
        """Abort everything in the core, publish the final snapshot and report the loop dead."""
        try:
            self.core.abort_requests(list(self._live))
            self._publish(CoreUpdate(EngineCoreOutputs(), self._refused, list(self._live),
                                     self.core.scheduler.stats()))
        except Exception:
            logger.exception("Could not abort the requests in flight.")
        self._live.clear()
        self._on_dead(reason)
