"""One engine core in a child process (a data-parallel replica), and `EngineReplica`, its end in the server process
(DPClient drives several).

The child builds an EngineCore (with its own executor, which may spawn tp x pp worker processes of its own), reports
its number of KV blocks, then runs an EngineCoreLoop: commands arrive over a duplex pipe (add, abort, finish after a
stop string, state snapshot, shutdown) and every CoreUpdate (and snapshot) goes back over it. In the parent a reader
thread hands the updates to the client's callback. A replica that exits (killed, crashed) closes its end of the
pipe: the reader sees that at once and reports the engine dead. Replicas die with the server (PR_SET_PDEATHSIG), so
none is left behind however the server ends.
"""
from __future__ import annotations

import itertools
import multiprocessing
import signal
import threading
import traceback
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.request import Request
from pagellm.engine.core_client import DeadCallback, UpdateCallback
from pagellm.engine.core_loop import StateCallback
from pagellm.engine.core_output import CoreUpdate
from pagellm.logger import init_logger
from pagellm.metrics.stats import SchedulerStats
from pagellm.process_utils import die_with_parent, kill_processes

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
        self._state_replies: dict[int, StateCallback] = {}  # state requests sent, by token
        self._state_tokens = itertools.count()

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

    def add_request(self, request: Request) -> None:
        self._send("add", request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send("abort", request_ids)

    def finish_stopped(self, stop_reasons: dict[str, str]) -> None:
        self._send("finish_stopped", stop_reasons)

    def request_state(self, reply: StateCallback) -> None:
        token = next(self._state_tokens)
        self._state_replies[token] = reply
        self._send("state", token)

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
                if not self._closing:
                    on_dead(f"Engine replica {self.engine_index} exited unexpectedly ({self._exit()}).")
                return
            if kind == "update":
                on_update(self.engine_index, payload)
            elif kind == "state":
                token, state = payload
                self._state_replies.pop(token)(state)
            elif not self._closing:  # "dead": its loop stopped
                on_dead(f"Engine replica {self.engine_index}: {payload}")
                return

    def _exit(self) -> str:
        self.process.join(_POLL_SECONDS)
        return f"pid {self.process.pid}, exit code {self.process.exitcode}"


def _run_engine_core(config: EngineConfig, max_waiting_requests: int | None, conn: Connection) -> None:
    """The replica process: build the core, then serve commands until shutdown or until the server goes away."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it shuts replicas down
    from pagellm.engine.core import EngineCore
    from pagellm.engine.core_loop import EngineCoreLoop

    try:
        core = EngineCore(config)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", (core.num_blocks, core.scheduler.stats())))

    def send(kind: str, payload: CoreUpdate | str | tuple) -> None:
        try:
            conn.send((kind, payload))
        except OSError:
            pass  # the server is gone; PR_SET_PDEATHSIG ends this process

    loop = EngineCoreLoop(core, lambda update: send("update", update), lambda reason: send("dead", reason),
                          max_waiting_requests)
    loop.start()
    commands = {"add": loop.add_request, "abort": loop.abort_requests, "finish_stopped": loop.finish_stopped,
                "state": lambda token: loop.request_state(lambda state: send("state", (token, state)))}
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            break
        if kind == "shutdown":
            break
        commands[kind](payload)
    loop.shutdown()
