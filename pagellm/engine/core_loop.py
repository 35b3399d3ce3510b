"""EngineCoreLoop: one EngineCore built and stepped by a thread of its own, fed through an inbox.

The loop owns the core: its thread builds it (loading the model) as well as steps it, so on the CPU every OpenMP
parallel region of the engine starts from that one thread. libgomp keeps a thread pool per thread that starts
regions; a second pool (the model loaded on the main thread, then stepped on this one) puts more pool threads on
the cores than there are cores, and libgomp then parks its idle workers almost at once, so every kernel call waits
for its workers to wake: a batch-1 decode step took 2.2x as long (9.6 against 4.4 ms on SmolLM2, 2 cores).
Nothing else touches the scheduler or the executor once it runs. Other threads (the server's
event loop, or a replica process's pipe reader) queue commands: add and abort (the hot path), `call_utility` (any
`@utility` method of EngineCore, by name: finish after a stop string, the dashboard's state snapshot, ...; its
result comes back in a Future) and shutdown. The loop applies them between steps, sleeps on the inbox while idle, and
after every pass publishes a CoreUpdate: the step's outputs, the requests it refused, the requests that left the
core, and a scheduler snapshot. When the core can no longer run (a worker died, the step raised), `on_dead(reason)`
is called once after every request has been aborted.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from pagellm.core.beam_group import BeamGroup
from pagellm.core.request import Request
from pagellm.engine.core import EngineCore
from pagellm.engine.core_output import CoreUpdate, EngineCoreOutputs
from pagellm.exceptions import EngineDeadError, QueueFullError
from pagellm.logger import init_logger

logger = init_logger(__name__)


@dataclass(slots=True)
class _Add:
    request: Request
    beam_group: BeamGroup | None


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass
class _Utility:
    method: str
    args: tuple[Any, ...]
    future: Future


@dataclass
class _ExecutorFailed:
    reason: str


_SHUTDOWN = object()


class EngineCoreLoop:
    def __init__(self, build_core: Callable[[], EngineCore], max_waiting_requests: int | None = None) -> None:
        """Start the loop's thread, which builds the core with `build_core` and then waits for `start`; returns once
        the core is built (raising what building it raised)."""
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # requests in the core, by request (group) id
        self._refused: dict[str, BaseException] = {}
        self._publish: Callable[[CoreUpdate], None] = lambda update: None
        self._on_dead: Callable[[str], None] = lambda reason: None
        self._started = threading.Event()
        built: Future = Future()
        self._thread = threading.Thread(target=self._main, args=(build_core, built), name="pagellm-engine",
                                        daemon=True)
        self._thread.start()
        self.core: EngineCore = built.result()
        # A worker that dies wakes the loop even when it is idle, so /health turns 503 at once.
        self.core.executor.on_failure(lambda reason: self._inbox.put(_ExecutorFailed(reason)))

    def start(self, publish: Callable[[CoreUpdate], None], on_dead: Callable[[str], None]) -> None:
        """Step the core from here on, reporting each pass to `publish` and the loop's end to `on_dead`."""
        self._publish, self._on_dead = publish, on_dead
        self._started.set()

    def _main(self, build_core: Callable[[], EngineCore], built: Future) -> None:
        try:
            built.set_result(build_core())
        except BaseException as exc:
            built.set_exception(exc)
            return
        self._started.wait()
        self._run()

    # ---- commands (any thread) --------------------------------------------------------------------------------
    def add_request(self, request: Request, beam_group: BeamGroup | None = None) -> None:
        self._inbox.put(_Add(request, beam_group))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._inbox.put(_Abort(request_ids))

    def call_utility(self, method: str, *args: Any) -> Future:
        """Run `EngineCore.call_utility(method, *args)` on the loop's thread between two steps. The future gets its
        result or the exception it raised (EngineDeadError once the loop has stopped); its callbacks run on the
        loop's thread."""
        future: Future = Future()
        self._inbox.put(_Utility(method, args, future))
        return future

    def shutdown(self) -> None:
        """Stop the loop (requests in flight are aborted) and the core's workers."""
        if self._thread.is_alive():
            self._inbox.put(_SHUTDOWN)
            self._started.set()  # a loop never started stops too: its first look at the inbox finds the shutdown
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
            if isinstance(item, _Add):
                self._add(item.request, item.beam_group)
            elif isinstance(item, _Abort):
                self.core.abort_requests(item.request_ids)
                self._live.difference_update(item.request_ids)
            elif isinstance(item, _Utility):
                self._run_utility(item)
            else:
                raise EngineDeadError(item.reason)  # _ExecutorFailed
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _run_utility(self, item: _Utility) -> None:
        if item.future.done():
            return  # the caller gave up on it, or was told the engine stopped
        try:
            result = self.core.call_utility(item.method, *item.args)
        except Exception as exc:  # the caller's to handle: a utility (a dashboard's snapshot) never stops the engine
            logger.exception("Engine utility %r failed.", item.method)
            resolve_future(item.future, False, exc)
        else:
            resolve_future(item.future, True, result)

    def _add(self, request: Request, beam_group: BeamGroup | None) -> None:
        try:
            if self.max_waiting_requests is not None:
                waiting = self.core.scheduler.num_waiting_for_capacity()
                if waiting >= self.max_waiting_requests:
                    raise QueueFullError(f"{waiting} requests are already waiting for capacity "
                                         f"(--max-waiting-requests); retry later.")
            self.core.add_request(request, beam_group)
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
        self._fail_pending_utilities(reason)
        self._on_dead(reason)

    def _fail_pending_utilities(self, reason: str) -> None:
        """Utility calls still queued will never run: their callers get EngineDeadError rather than wait forever."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Utility):
                resolve_future(item.future, False, EngineDeadError(reason))


def resolve_future(future: Future, ok: bool, value: Any) -> None:
    """Set a utility call's result (`ok`) or exception, unless it is already settled: cancelled by its caller, or
    failed because the engine stopped (the front end fails its calls then, from another thread)."""
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except InvalidStateError:
        pass
