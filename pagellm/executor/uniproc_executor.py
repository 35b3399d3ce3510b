"""The executor for one worker in this process (on the engine's thread)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np

from pagellm.config import EngineConfig
from pagellm.core.sched_output import GrammarOutput, SchedulerOutput
from pagellm.executor.abstract import Executor
from pagellm.worker.async_output import AsyncModelRunnerOutput
from pagellm.worker.model_runner import ModelRunnerOutput
from pagellm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self._start_workers()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, output: SchedulerOutput, bitmask: Future[np.ndarray] | None = None
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        # The forward pass runs on this thread while the bitmask is computed on the structured-output manager's.
        result = self.worker.execute_model(output)
        return result if result is not None else self.worker.sample_tokens(GrammarOutput.from_future(bitmask))
