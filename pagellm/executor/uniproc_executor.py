"""The executor for one worker in this process (on the engine's thread)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np

from pagellm.config import EngineConfig
from pagellm.core.sched.output import GrammarOutput, SchedulerOutput
from pagellm.executor.abstract import Executor
from pagellm.worker.async_output import AsyncModelRunnerOutput
from pagellm.worker.model_runner import ModelRunnerOutput
from pagellm.worker.worker import Worker

# A submitted step whose sampling waits for `sample_submitted`.
_AWAITING_SAMPLE = object()


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

    def submit_forward(self, output: SchedulerOutput) -> None:
        def forward() -> Any:
            result = self.worker.execute_model(output)
            return _AWAITING_SAMPLE if result is None else result

        self._submit(forward)

    def sample_submitted(self, bitmask: Future[np.ndarray]) -> None:
        index = len(self._submitted) - 1
        if self._submitted[index] is not _AWAITING_SAMPLE:
            return  # the forward pass failed: collecting the step raises that
        try:
            self._submitted[index] = self.worker.sample_tokens(GrammarOutput.from_future(bitmask))
        except Exception as exc:
            self._submitted[index] = exc
