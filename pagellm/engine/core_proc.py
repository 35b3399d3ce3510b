"""One engine core in a child process (a data-parallel replica), and `EngineReplica`, its end in the server process
(DPClient drives several).

The child builds an EngineCore (with its own executor, which may spawn tp x pp worker processes of its own), reports
its number of KV blocks, then runs an EngineCoreLoop: commands arrive over a duplex pipe (add, abort, a utility call
by name, shutdown) and every CoreUpdate (and utility result) goes back over it. In the parent a reader
thread hands the updates to the client's callback. A replica that exits (killed, crashed) closes its end of the
pipe: the reader sees that at once and reports the engine dead. Replicas die with the server (PR_SET_PDEATHSIG), so
none is left behind however the server ends.
"""
from __future__ import annotations

import itertools
import multiprocessing
import pickle
import signal
import threading
import traceback
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.beam_group import BeamGroup
from pagellm.core.request import Request
from pagellm.engine.core import EngineCore
from pagellm.engine.core_client import DeadCallback, UpdateCallback
from pagellm.engine.core_loop import EngineCoreLoop, resolve_future
from pagellm.engine.core_output import CoreUpdate
from pagellm.exceptions import EngineDeadError
from pagellm.logger import init_logger
from pagellm.metrics.stats import SchedulerStats
from pagellm.process_utils import die_with_parent, freeze_startup_heap, kill_processes

logger = init_logger(__name__)

_POLL_SECONDS = 0.1
_SHUTDOWN_GRACE_SECONDS = 10.0


class EngineReplica:
    """Spawns the replica at construction; `wait_ready()` blocks until its model is loaded (so several replicas
    load at once). The command methods may be called from any thread."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        # Spawned, not forked where safe as worker ranks are (process_utils): the server that starts replicas has the
        # `__main__` guard, and a fresh interpreter keeps its threads and state out. A replica may fork its own ranks.
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        # Not daemonic: a replica with tp x pp > 1 starts worker processes of its own.
        self.process: BaseProcess = context.Process(target=_run_engine_core, name=f"pagellm-engine-{engine_index}",
                                                    args=(config, max_waiting_requests, child_end))
        self.process.start()
        child_end.close()
        self._finalizer = weakref.finalize(self, kill_processes, [self.process])
        self._send_lock = threading.Lock()
        self._closing = False
        self._num_blocks = 0
        self._initial_stats: SchedulerStats | None = None
        self._utility_calls: dict[int, Future] = {}  # utility calls sent and not yet answered, by token
        self._utility_tokens = itertools.count()
        self._utility_lock = threading.Lock()  # the calls: callers add, the reader resolves

    def wait_ready(self) -> None:
        while not self._conn.poll(_POLL_SECONDS):
            if not self.process.is_alive():
                raise RuntimeError(f"Engine replica {self.engine_index} exited while starting ({self._exit()}); "
                                   f"see the log above.")
        kind, payload = self._conn.recv()
        if kind == "error":
            self.shutdown()
            raise RuntimeError(f"Engine replica {self.engine_index} failed to start:\n{payload}")
        self._num_blocks, self._initial_stats = payload

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def initial_stats(self) -> SchedulerStats:
        return self._initial_stats

    def start(self, on_update: UpdateCallback, on_dead: DeadCallback) -> None:
        threading.Thread(target=self._read, args=(on_update, on_dead), daemon=True,
                         name=f"pagellm-engine-{self.engine_index}-reader").start()

    def add_request(self, request: Request, beam_group: BeamGroup | None = None) -> None:
        self._send("add", (request, beam_group))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send("abort", request_ids)

    def call_utility(self, method: str, *args: Any) -> Future:
        """Run `EngineCore.call_utility(method, *args)` in the replica; the future is resolved by the reader."""
        future: Future = Future()
        with self._utility_lock:
            token = next(self._utility_tokens)
            self._utility_calls[token] = future
        self._send("utility", (token, method, args))
        return future

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._send("shutdown", None)
        self.process.join(_SHUTDOWN_GRACE_SECONDS)
        self._finalizer()  # kills it if it did not stop in time
        self._conn.close()

    def _send(self, kind: str, payload: Any) -> None:
        try:
            with self._send_lock:
                self._conn.send((kind, payload))
        except OSError:
            pass  # the replica is gone: the reader reports it

    def _read(self, on_update: UpdateCallback, on_dead: DeadCallback) -> None:
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                reason = f"Engine replica {self.engine_index} exited unexpectedly ({self._exit()})."
                self._fail_utility_calls(reason)
                if not self._closing:
                    on_dead(reason)
                return
            if kind == "update":
                on_update(self.engine_index, payload)
            elif kind == "utility":
                token, ok, value = payload
                with self._utility_lock:
                    future = self._utility_calls.pop(token)
                resolve_future(future, ok, value)
            elif not self._closing:  # "dead": its loop stopped
                self._fail_utility_calls(f"Engine replica {self.engine_index}: {payload}")
                on_dead(f"Engine replica {self.engine_index}: {payload}")
                return

    def _fail_utility_calls(self, reason: str) -> None:
        with self._utility_lock:
            calls, self._utility_calls = self._utility_calls, {}
        for future in calls.values():
            resolve_future(future, False, EngineDeadError(reason))

    def _exit(self) -> str:
        self.process.join(_POLL_SECONDS)
        return f"pid {self.process.pid}, exit code {self.process.exitcode}"


def _run_engine_core(config: EngineConfig, max_waiting_requests: int | None, conn: Connection) -> None:
    """The replica process: build the core, then serve commands until shutdown or until the server goes away."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it shuts replicas down

    try:
        # Built on the loop's thread, which steps it (see core_loop.py).
        loop = EngineCoreLoop(lambda: EngineCore(config), max_waiting_requests)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    freeze_startup_heap()
    conn.send(("ready", (loop.core.num_blocks, loop.core.scheduler.stats())))

    send_lock = threading.Lock()  # the loop's thread sends; a utility call that finished at once sends from here

    def send(kind: str, payload: CoreUpdate | str | tuple) -> None:
        try:
            with send_lock:
                conn.send((kind, payload))
        except OSError:
            pass  # the server is gone; PR_SET_PDEATHSIG ends this process

    def call_utility(token: int, method: str, args: tuple) -> None:
        loop.call_utility(method, *args).add_done_callback(lambda future: send("utility", (token, *_outcome(future))))

    loop.start(lambda update: send("update", update), lambda reason: send("dead", reason))
    commands = {"add": lambda payload: loop.add_request(*payload), "abort": loop.abort_requests,
                "utility": lambda payload: call_utility(*payload)}
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            break
        if kind == "shutdown":
            break
        commands[kind](payload)
    loop.shutdown()


def _outcome(future: Future) -> tuple[bool, Any]:
    """(True, result) or (False, exception) of a finished utility call, as something that pickles."""
    exc = future.exception()
    if exc is None:
        return True, future.result()
    try:
        pickle.dumps(exc)
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return False, exc

