"""The engine's only way to its workers: an Executor runs each step on every rank and returns the output rank's
result (`ParallelConfig.output_rank`: the last pipeline stage's first tensor-parallel rank).
`Executor.create` picks the implementation from `--distributed-executor-backend`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.sched_output import SchedulerOutput
from pagellm.worker.model_runner import ModelRunnerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure_callbacks: list[Callable[[str], None]] = []

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
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; returns the output rank's output."""

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker is gone."""

    def shutdown(self) -> None:
        """Stop the workers; the executor is unusable afterwards."""

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Have `callback(reason)` called (from any thread) when a worker dies, even while the engine is idle."""
        self._failure_callbacks.append(callback)

    def _report_failure(self, reason: str) -> None:
        for callback in self._failure_callbacks:
            callback(reason)

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def determine_num_host_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_host_blocks"))

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.collective_rpc("initialize_cache", num_blocks, num_host_blocks)
