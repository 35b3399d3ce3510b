"""EngineCore: the step loop. Schedule, execute on the workers, update request state."""
from __future__ import annotations

from pagellm.config import EngineConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.engine.request import Request, RequestStatus
from pagellm.executor.uniproc_executor import UniProcExecutor
from pagellm.logger import init_logger
from pagellm.worker.cache_engine import kv_bytes_per_block
from pagellm.worker.worker import GiB

logger = init_logger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = UniProcExecutor(config)
        num_blocks = self.executor.determine_num_blocks()
        config.cache_config.num_blocks = num_blocks
        self.executor.initialize_cache(num_blocks)
        self._log_cache(num_blocks)
        self.kv_cache_manager = KVCacheManager(num_blocks, config.cache_config.block_size)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)

    def _log_cache(self, num_blocks: int) -> None:
        block_size = self.config.cache_config.block_size
        max_len = self.config.scheduler_config.max_model_len
        size = num_blocks * kv_bytes_per_block(self.config.model_config, block_size)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), %d tokens in all; maximum concurrency for "
                    "%d-token requests: %.2fx", num_blocks, block_size, size / GiB, num_blocks * block_size,
                    max_len, num_blocks * block_size / max_len)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str], status: RequestStatus,
                        stop_reasons: dict[str, int | str] | None = None) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, status, stop_reasons)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[list[Request], list[Request]]:
        """One scheduling step; returns (requests with a new token, requests that finished)."""
        output = self.scheduler.schedule()
        if output.is_empty and self.scheduler.has_unfinished_requests():
            # Every admitted request fits the pool on its own, so this means a bookkeeping bug: fail, never hang.
            raise RuntimeError("The scheduler could not schedule any of the unfinished requests.")
        result = self.executor.execute_model(output)
        return self.scheduler.update_from_output(output, result.sampled_token_ids, result.logprobs,
                                                 result.prompt_logprobs)
