"""One worker process per rank on this machine (`--distributed-executor-backend mp`).

Each rank is a child process running a Worker, forked where that is safe, else spawned (see process_utils); a forked
rank never imports the main script, so a script without a `__main__` guard works. The ranks form a torch.distributed
group (see distributed/) for the model's collectives. The engine talks to them over one pipe each: every call is
pickled once and its bytes written to every pipe; each rank answers on its own pipe (only the output rank, the last
pipeline stage's first tensor-parallel rank, with the step's result). A step with constrained sequences sends the
output rank a second message, `sample_tokens` with the grammar bitmask, once the engine has computed it while the
ranks run the forward pass; the rank reads it after its forward pass (its pipe keeps the order, also with several
batches in flight) and answers both calls. Steps without constraints send nothing more.

Failure is noticed fast. A monitor thread waits on the processes' sentinels: when a worker exits while the executor
runs, the executor is marked dead, the failure callbacks run (the server turns /health to 503 even when idle), and
the other ranks are killed (they would wait forever in a collective with the dead one). A call in progress notices
within 50 ms. Worker processes also die with the engine process (PR_SET_PDEATHSIG on Linux), so no orphan is left
behind even if the engine is killed. A rank that dies while starting under spawn may have died importing the main
script: the error then says to add the guard.
"""
from __future__ import annotations

import contextlib
import pickle
import signal
import socket
import threading
import traceback
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from pagellm.config import EngineConfig
from pagellm.core.sched.output import GrammarOutput, SchedulerOutput
from pagellm.exceptions import EngineDeadError
from pagellm.executor.abstract import Executor
from pagellm.logger import init_logger
from pagellm.process_utils import (
    die_with_parent,
    get_mp_context,
    kill_processes,
    quiet_thread,
    run_on_new_thread,
    startup_hint,
)
from pagellm.worker.model_runner import ModelRunnerOutput

logger = init_logger(__name__)

_POLL_SECONDS = 0.05
_SHUTDOWN_GRACE_SECONDS = 5.0
_DEATH_GRACE_SECONDS = 1.0  # how long a failed collective waits to see whether a rank died (see _dead_worker)


@dataclass
class _WorkerProcess:
    rank: int
    process: BaseProcess
    conn: Connection


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._closing = False
        context = get_mp_context()
        self._startup_hint = startup_hint(context)  # for a rank that dies before the workers are ready
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.workers: list[_WorkerProcess] = []
        for rank in range(config.parallel_config.world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=_run_worker, args=(config, rank, init_method, child_end),
                                      name=f"pagellm-worker-{rank}", daemon=True)
            process.start()
            child_end.close()
            self.workers.append(_WorkerProcess(rank, process, parent_end))
        self._output_worker = self.workers[config.parallel_config.output_rank]
        self._sampled_apart: deque[bool] = deque()  # per submitted step: does its sampling wait for a bitmask?
        # An executor dropped without shutdown() (an LLM going out of scope) still stops its processes.
        self._finalizer = weakref.finalize(self, kill_processes, [worker.process for worker in self.workers])
        quiet_thread(threading.Thread(target=_monitor, args=(weakref.ref(self), self.workers),
                                      name="pagellm-worker-monitor", daemon=True)).start()
        self._start_workers()
        self._startup_hint = ""

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._send_all(method, args)
        return [self._receive(worker) for worker in self.workers]

    @property
    def max_concurrent_batches(self) -> int:
        # With pipeline_overlap, one batch per stage: each rank works through its pipe in order, so while the last
        # stage runs batch N the first can run batch N + 1.
        return self.config.parallel_config.concurrent_stages

    def execute_model(self, output: SchedulerOutput, bitmask: Future[np.ndarray] | None = None) -> ModelRunnerOutput:
        self.submit_model(output, bitmask)
        return self.collect_model_output()

    def submit_model(self, output: SchedulerOutput, bitmask: Future[np.ndarray] | None = None) -> None:
        self._send_all("execute_model", (output,))
        if bitmask is not None:
            # While the ranks run the forward pass: the bitmask goes to the one that samples, which reads it next.
            message = pickle.dumps(("sample_tokens", (GrammarOutput.from_future(bitmask),)),
                                   protocol=pickle.HIGHEST_PROTOCOL)
            self._send(self._output_worker, message)
        self._sampled_apart.append(bitmask is not None)

    def collect_model_output(self) -> ModelRunnerOutput:
        sampled_apart = self._sampled_apart.popleft()  # then the output rank answers twice: None, then the result
        try:
            results = [self._receive(worker) for worker in self.workers]
        except EngineDeadError:
            raise
        except RuntimeError:
            if sampled_apart:  # one rank whose forward pass failed: its sample_tokens call failed too
                with contextlib.suppress(RuntimeError):
                    self._receive(self._output_worker)
            raise
        return self._receive(self._output_worker) if sampled_apart else results[self._output_worker.rank]

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for worker in self.workers:
            try:
                worker.conn.send_bytes(pickle.dumps(("shutdown", ())))
            except OSError:
                pass  # already gone
        for worker in self.workers:
            worker.process.join(_SHUTDOWN_GRACE_SECONDS)
            worker.conn.close()
        self._finalizer()

    # ---- calls ------------------------------------------------------------------------------------------------
    def _send_all(self, method: str, args: tuple) -> None:
        self.check_health()
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self.workers:
            self._send(worker, message)

    def _send(self, worker: _WorkerProcess, message: bytes) -> None:
        try:
            worker.conn.send_bytes(message)
        except OSError as exc:
            raise EngineDeadError(self._fail(f"Worker rank {worker.rank} cannot be reached ({exc}).")) from exc

    def _receive(self, worker: _WorkerProcess) -> Any:
        while not worker.conn.poll(_POLL_SECONDS):
            if self._failure is not None or not worker.process.is_alive():
                raise EngineDeadError(self._failure or self._fail(self._exit_message(worker)))
        try:
            status, payload = pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError) as exc:  # its end of the pipe closed: it is exiting
            raise EngineDeadError(self._failure or self._fail(self._exit_message(worker))) from exc
        if status == "error":
            message = f"Worker rank {worker.rank} failed:\n{payload}"
            if len(self.workers) > 1:
                # The other ranks may be waiting in a collective this rank never reached: the group is unusable.
                # A rank that died is why a collective failed on the others: it is named first, whichever of the
                # two reached this process first.
                dead = self._dead_worker()
                if dead is not None:
                    message = f"{self._exit_message(dead)}\n{message}"
                raise EngineDeadError(self._fail(message))
            raise RuntimeError(message)
        return payload

    # ---- failure ----------------------------------------------------------------------------------------------
    def _dead_worker(self) -> _WorkerProcess | None:
        """A rank that has exited, waiting up to _DEATH_GRACE_SECONDS for one: a killed rank's sockets close (and the
        others' collectives fail) a moment before its exit can be seen here, longer on a loaded host."""
        sentinels = {worker.process.sentinel: worker for worker in self.workers}
        ready = wait(list(sentinels), timeout=_DEATH_GRACE_SECONDS)
        return sentinels[ready[0]] if ready else None

    def _kill_workers(self) -> None:
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.kill()

    def _exit_message(self, worker: _WorkerProcess) -> str:
        worker.process.join(_POLL_SECONDS)
        return (f"Worker process rank {worker.rank} (pid {worker.process.pid}) exited unexpectedly (exit code "
                f"{worker.process.exitcode}).{self._startup_hint}")


def _monitor(executor_ref: weakref.ref, workers: list[_WorkerProcess]) -> None:
    """Wait for any worker process to exit; unless the executor is shutting down, that is a failure. Holds the
    executor weakly, so an executor nobody uses can still be collected."""
    sentinels = {worker.process.sentinel: worker for worker in workers}
    ready = wait(list(sentinels))
    executor = executor_ref()
    if executor is not None and not executor._closing:
        executor._fail(executor._exit_message(sentinels[ready[0]]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_worker(config: EngineConfig, rank: int, init_method: str, conn: Connection) -> None:
    """A worker process: answer calls until told to shut down or the engine's end of the pipe closes."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it shuts the workers down
    run_on_new_thread(_serve, config, rank, init_method, conn)


def _serve(config: EngineConfig, rank: int, init_method: str, conn: Connection) -> None:
    from pagellm.worker.worker import Worker

    worker = Worker(config, rank=rank, distributed_init_method=init_method)
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if method == "shutdown":
            return
        try:
            result = getattr(worker, method)(*args)
            if method == "execute_model" and rank != config.parallel_config.output_rank:
                result = None  # only the output rank's result is used: do not pay for pickling the others
            reply = ("ok", result)
        except Exception:
            reply = ("error", traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
