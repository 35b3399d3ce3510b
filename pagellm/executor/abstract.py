"""The engine's only way to its workers: an Executor runs each step on every rank and returns the output rank's
result (`ParallelConfig.output_rank`: the last pipeline stage's first tensor-parallel rank, the only one that
samples). A step with constrained sequences reaches that rank in two calls, the forward pass (`execute_model`) and,
once the engine has their grammar bitmask, the sampling (`sample_tokens`), so the two overlap.
`Executor.create` picks the implementation from `--distributed-executor-backend`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from pagellm.config import EngineConfig
from pagellm.core.sched.output import SchedulerOutput
from pagellm.exceptions import EngineDeadError
from pagellm.logger import init_logger
from pagellm.worker.async_output import AsyncModelRunnerOutput
from pagellm.worker.model_runner import ModelRunnerOutput

logger = init_logger(__name__)


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure: str | None = None  # why the workers are gone, once they are
        self._failure_callbacks: list[Callable[[str], None]] = []
        # Results of submitted steps, oldest first (with async scheduling, tokens perhaps still on the device).
        self._submitted: deque[ModelRunnerOutput | AsyncModelRunnerOutput | Exception] = deque()

    @staticmethod
    def create(config: EngineConfig) -> Executor:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from pagellm.executor.uniproc_executor import UniProcExecutor
            return UniProcExecutor(config)
        if backend == "mp":
            from pagellm.executor.multiproc_executor import MultiprocExecutor
            return MultiprocExecutor(config)
        from pagellm.executor.ray_executor import RayExecutor
        return RayExecutor(config)

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every worker; returns one result per rank, in rank order."""

    @abstractmethod
    def execute_model(self, output: SchedulerOutput, bitmask: Future[np.ndarray] | None = None
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run one step on every rank; returns the output rank's output (with async scheduling, one rank in this
        process: perhaps before its sampled tokens have reached the host). `bitmask`, for a step with constrained
        sequences, is their bitmask being computed (see core/sched/output.py): the output rank runs the forward
        pass meanwhile and waits for it only to sample (its `execute_model` returns None, `sample_tokens` the
        result)."""

    @property
    def max_concurrent_batches(self) -> int:
        """How many batches may be submitted before the oldest is collected: 1, unless the executor can keep
        pipeline stages busy with different batches."""
        return 1

    def submit_model(self, output: SchedulerOutput, bitmask: Future[np.ndarray] | None = None) -> None:
        """Start a step (`bitmask` as in `execute_model`); its result comes from `collect_model_output`, in
        submission order. Here the step runs at once (an executor with max_concurrent_batches > 1 only sends it)."""
        self._submit(lambda: self.execute_model(output, bitmask))

    def _submit(self, run: Callable[[], Any]) -> None:
        """Queue what `run` returns for collection, or what it raises: raised when the step is collected, as an
        asynchronous executor would (a dead worker raises at once)."""
        try:
            self._submitted.append(run())
        except EngineDeadError:
            raise
        except Exception as exc:
            self._submitted.append(exc)

    def submit_forward(self, output: SchedulerOutput) -> None:
        """Async scheduling: start a step whose constrained sequences continue blind, up to their sampling (their
        bitmask needs the step before applied first); `sample_submitted` finishes it. One rank in this process."""
        raise NotImplementedError("Async scheduling runs on the uni executor only.")

    def sample_submitted(self, bitmask: Future[np.ndarray]) -> None:
        """Sample the newest step `submit_forward` started, under `bitmask`."""
        raise NotImplementedError("Async scheduling runs on the uni executor only.")

    def collect_model_output(self) -> ModelRunnerOutput:
        """The result of the oldest submitted step (raises what the step raised)."""
        result = self._submitted.popleft()
        if isinstance(result, Exception):
            raise result
        return result.get() if isinstance(result, AsyncModelRunnerOutput) else result

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker is gone."""
        if self._failure is not None:
            raise EngineDeadError(self._failure)

    def shutdown(self) -> None:  # noqa: B027 (a hook: nothing to stop in process)
        """Stop the workers; the executor is unusable afterwards."""

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Have `callback(reason)` called (from any thread) when a worker dies, even while the engine is idle."""
        self._failure_callbacks.append(callback)

    def _start_workers(self) -> None:
        """Set up every rank's device and model; if that fails, stop what was started."""
        try:
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _fail(self, reason: str) -> str:
        """Mark the executor dead (once), stop the workers still running (they may wait forever in a collective
        with the dead one) and tell the callbacks; returns the first reason."""
        if self._failure is None:
            self._failure = reason
            logger.error("%s Stopping the other workers.", reason)
            self._kill_workers()
            for callback in self._failure_callbacks:
                callback(reason)
        return self._failure

    def _kill_workers(self) -> None:  # noqa: B027 (a hook: nothing to kill in process)
        """Stop every worker at once (executors with workers outside this process)."""

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def determine_num_host_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_host_blocks"))

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.collective_rpc("initialize_cache", num_blocks, num_host_blocks)
