"""The executor for one worker in this process. Multi-worker executors keep the same interface."""
from __future__ import annotations

from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.sched_output import SchedulerOutput
from pagellm.worker.model_runner import ModelRunnerOutput
from pagellm.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = Worker(config)
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every worker; returns one result per worker."""
        return [getattr(self.worker, method)(*args)]

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def determine_num_host_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_host_blocks"))

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.collective_rpc("initialize_cache", num_blocks, num_host_blocks)

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", output)[0]
