"""The executor for one worker in this process."""
from __future__ import annotations

from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.sched_output import SchedulerOutput
from pagellm.executor.abstract import Executor
from pagellm.worker.model_runner import ModelRunnerOutput
from pagellm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self._start_workers()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(output)
