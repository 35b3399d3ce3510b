"""One worker: owns a device, the model on it, the KV cache tensors (device blocks and the host tier), sizes both
from memory budgets, applies each step's block moves before its forward pass, and runs the step (in two calls when
it samples under a grammar whose bitmask is computed meanwhile: `execute_model`, then `sample_tokens`)."""
from __future__ import annotations

import os

import torch

from pagellm.config import EngineConfig
from pagellm.core.kv.kv_cache_groups import blocks_needed, kv_cache_groups, layer_positions
from pagellm.core.sched.output import GrammarOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from pagellm.distributed.parallel_state import stage_layer_range
from pagellm.logger import init_logger
from pagellm.model_executor.layers.attention import check_kv_cache_dtype, layer_sliding_window
from pagellm.model_executor.models.registry import is_encoder_only
from pagellm.sampling_params import SamplingParams
from pagellm.worker.async_output import AsyncModelRunnerOutput
from pagellm.worker.cache_engine import CacheEngine, kv_bytes_per_block
from pagellm.worker.cpu_affinity import available_cores, bind_to_cores, slot_groups
from pagellm.worker.draft_proposer import DraftModelProposer
from pagellm.worker.host_allocator import keep_large_allocations_on_heap
from pagellm.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = init_logger(__name__)

GiB = 1 << 30
# On CPU the KV cache shares RAM with everything else: take a modest share of what is free, like vLLM's
# 4 GiB default for its CPU backend.
_CPU_KV_SHARE = 0.3
_CPU_KV_MAX_BYTES = 4 * GiB
# The host tier must leave the process and the rest of the machine room to run (vLLM warns above 40% of RAM).
_MAX_HOST_TIER_SHARE = 0.5


def available_host_memory() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Worker:
    """One rank. `distributed_init_method` (e.g. tcp://host:port) is how the ranks find each other when there is
    more than one."""

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        parallel = config.parallel_config
        self.tensor_parallel_size = parallel.tensor_parallel_size
        # The decoder layers (and so the KV cache layers) of this rank's pipeline stage.
        start, end = stage_layer_range(config.model_config.num_layers, parallel.pp_rank(rank),
                                       parallel.pipeline_parallel_size)
        self.num_layers = end - start
        # KV cache groups (core/kv/kv_cache_groups.py): this stage's layers' cache tensors, one per distinct position.
        model_config = config.model_config
        self.kv_groups = kv_cache_groups([layer_sliding_window(model_config.hf_config, i)
                                          for i in range(model_config.num_layers)])
        positions = layer_positions(self.kv_groups)
        used = sorted({positions[layer][1] for layer in range(start, end)})
        self.layer_tensors = [used.index(positions[layer][1]) for layer in range(start, end)]
        device = config.device_config.device
        # One GPU per rank on this machine; data-parallel replicas take the next world_size GPUs each.
        gpu = parallel.data_parallel_rank * parallel.world_size + rank
        self.device = torch.device("cuda", gpu % torch.cuda.device_count()) if device.type == "cuda" else device
        # Only the rank whose result the engine reads samples.
        self.model_runner = ModelRunner(config.model_config, config.cache_config.block_size, self.device,
                                        samples=rank == parallel.output_rank,
                                        async_output=config.scheduler_config.async_scheduling,
                                        lora_config=config.lora_config, kv_groups=self.kv_groups)
        self.cache_engine: CacheEngine | None = None
        self.cpu_cores: list[int] | None = None  # the cores --cpu-affinity bound this rank to
        # An encoder attends over whole prompts and keeps no K/V (layers/attention/encoder.py): its blocks are the
        # scheduler's bookkeeping only, with no cache tensors behind them.
        self.encoder_only = is_encoder_only(config.model_config.architecture)
        # Speculative method draft_model: the draft model drafts into the step's placeholder slots, in a KV cache of
        # its own addressed by the same block tables (worker/draft_proposer.py).
        spec = config.scheduler_config.speculative_config
        self.draft_proposer: DraftModelProposer | None = None
        if spec is not None and spec.method == "draft_model":
            if spec.draft_model_config is None:
                raise ValueError("speculative_config method 'draft_model' needs its draft_model_config, which "
                                 "EngineArgs resolves from speculative_config.model; build the config with EngineArgs.")
            self.draft_proposer = DraftModelProposer(spec.draft_model_config, config.cache_config, self.device)
        self._step_drafts: dict[str, list[int]] = {}  # the drafts of the step waiting for its grammar bitmask

    def init_device(self) -> None:
        parallel = self.config.parallel_config
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            model_dtype = self.config.model_config.dtype
            check_kv_cache_dtype(self.config.cache_config.kv_dtype(model_dtype), model_dtype, self.device)
        else:
            keep_large_allocations_on_heap()
            if parallel.cpu_affinity:
                groups = slot_groups(parallel.cpu_affinity, parallel.concurrent_ranks, available_cores())
                self.cpu_cores = groups[parallel.cpu_slot(self.rank)]
                bind_to_cores(self.cpu_cores)
            elif parallel.world_size > 1 or parallel.data_parallel_size > 1:
                # The ranks (of every replica) share this machine's cores instead of each spawning a thread per
                # core; with pipeline_overlap the stages work on different batches at once, so they count too.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.concurrent_ranks))
        if parallel.world_size > 1:
            from pagellm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            init_distributed_environment(parallel.world_size, self.rank, self.distributed_init_method, backend)
            initialize_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        torch.manual_seed(self.config.model_config.seed)

    def load_model(self) -> None:
        self.model_runner.load_model()
        if self.draft_proposer is not None:
            self.draft_proposer.load_model()

    def weight_bytes(self) -> int:
        return self.model_runner.weight_bytes()

    def determine_kv_cache_bytes(self) -> int:
        cache_config = self.config.cache_config
        if cache_config.kv_cache_memory_bytes is not None:
            return cache_config.kv_cache_memory_bytes
        if self.device.type == "cpu":
            # Replicas start at once and would each see the same free memory: each takes its part of the share.
            replicas = self.config.parallel_config.data_parallel_size
            return int(min(_CPU_KV_MAX_BYTES, _CPU_KV_SHARE * available_host_memory()) / replicas)
        return self._profile_cuda_budget()

    def _profile_cuda_budget(self) -> int:
        """Run the largest batch the scheduler may build, then give the KV cache what is left of
        gpu_memory_utilization of the device."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.profile_run()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        non_torch = (total - free) - torch.cuda.memory_reserved()
        peak = torch.cuda.max_memory_allocated()
        budget = int(total * self.config.cache_config.gpu_memory_utilization) - peak - max(non_torch, 0)
        logger.info("Memory profiling: peak activations+weights %.2f GiB, other %.2f GiB, KV budget %.2f GiB",
                    peak / GiB, non_torch / GiB, budget / GiB)
        return max(budget, 0)

    def profile_run(self) -> None:
        """A forward pass over max_num_batched_tokens tokens (split into sequences of at most max_model_len)
        with a throwaway cache just big enough for it."""
        sched, block_size = self.config.scheduler_config, self.config.cache_config.block_size
        num_tokens, max_len = sched.max_num_batched_tokens, self.config.model_config.max_model_len
        lengths = [min(max_len, num_tokens - start) for start in range(0, num_tokens, max_len)]
        output, next_block = SchedulerOutput(), 0
        for i, length in enumerate(lengths):
            num_blocks = -(-length // block_size)
            output.new_requests.append(NewRequestData(f"profile-{i}", [0] * length, [],
                                                      SamplingParams(temperature=1.0, top_p=0.9, top_k=50)))
            blocks = list(range(next_block, next_block + num_blocks))
            output.scheduled.append(ScheduledRequest(f"profile-{i}", length, 0, [], blocks, True,
                                                     new_group_block_ids=[blocks] * (len(self.kv_groups) - 1)))
            next_block += num_blocks
        self._attach_cache(next_block)
        result = self.model_runner.execute_model(output)
        if isinstance(result, AsyncModelRunnerOutput):
            result.get()
        self.model_runner.forget_requests()
        self.cache_engine = None
        self.model_runner.kv_caches = []

    def determine_num_blocks(self) -> int:
        cache_config = self.config.cache_config
        if self.encoder_only:  # nothing to profile or allocate: room for a whole prompt in every sequence slot
            blocks = self.config.scheduler_config.max_num_seqs * -(-self.config.model_config.max_model_len
                                                                   // cache_config.block_size)
            logger.info("Encoder-only model: no KV cache; the scheduler counts %d blocks of %d tokens.", blocks,
                        cache_config.block_size)
            return blocks
        # A draft model's cache has as many blocks as the target's (the same block tables address both).
        per_block = self._kv_bytes_per_block() + (self.draft_proposer.bytes_per_block() if self.draft_proposer else 0)
        budget = self.determine_kv_cache_bytes()
        num_blocks = budget // per_block
        max_len = self.config.model_config.max_model_len
        # One request of max_model_len: every token in the full-attention groups, a sliding group only its window
        # and the last chunk (what admission counts, see KVCacheManager.num_blocks_needed).
        chunk = min(max_len, self.config.scheduler_config.max_num_batched_tokens)
        needed = blocks_needed([group.window for group in self.kv_groups], max_len - chunk, chunk,
                               cache_config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"The KV cache budget of {budget / GiB:.3f} GiB holds {num_blocks} blocks "
                f"({num_blocks * cache_config.block_size} tokens), but one request of max_model_len={max_len} tokens "
                f"needs {needed} blocks ({needed * per_block / GiB:.3f} GiB). Increase the KV cache memory "
                f"(kv_cache_memory_bytes / --kv-cache-memory, or gpu_memory_utilization on CUDA) or lower "
                f"max_model_len (--max-model-len).")
        block_size = cache_config.block_size
        kv_dtype = str(cache_config.kv_dtype(self.config.model_config.dtype)).removeprefix("torch.")
        logger.info("KV cache (%s): %d blocks of %d tokens (%.2f GiB), %d tokens in all; maximum concurrency for "
                    "%d-token requests: %.2fx", kv_dtype, num_blocks, block_size, num_blocks * per_block / GiB,
                    num_blocks * block_size, max_len, num_blocks * block_size / max_len)
        return int(num_blocks)

    def determine_num_host_blocks(self) -> int:
        """Blocks of the host tier: swap_space_bytes of host memory, capped (with a warning) at half of what the
        host has free, since the tier is allocated up front (pinned on CUDA)."""
        if self.encoder_only:  # an encoder keeps no K/V to swap
            return 0
        per_block = self._kv_bytes_per_block()
        swap_bytes, free = self.config.cache_config.swap_space_bytes, available_host_memory()
        limit = int(_MAX_HOST_TIER_SHARE * free / self.config.parallel_config.data_parallel_size)
        if swap_bytes > limit:
            logger.warning("The swap space of %.2f GiB is more than %.0f%% of the free host memory (%.2f GiB); the "
                           "host tier gets %.2f GiB. Lower --swap-space to silence this.", swap_bytes / GiB,
                           100 * _MAX_HOST_TIER_SHARE, free / GiB, limit / GiB)
            swap_bytes = limit
        return swap_bytes // per_block

    def _kv_bytes_per_block(self) -> int:
        """One block of this rank's KV cache: its KV heads, its pipeline stage's cache tensors (one per layer, or per
        position in a KV cache group)."""
        return kv_bytes_per_block(self.config.model_config, self.config.cache_config, self.tensor_parallel_size,
                                  max(self.layer_tensors) + 1)

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """The KV cache of `num_blocks` blocks (and the host tier); on CUDA, then the decode graphs, which take one
        more block, past the scheduler's, for their padding rows."""
        if self.encoder_only:  # nothing is cached: a one-block cache that no layer reads, no host tier or graphs
            self._attach_cache(1)
            return
        graphs = self.uses_decode_graphs()
        self._attach_cache(num_blocks + graphs, num_host_blocks)
        if self.draft_proposer is not None:
            self.draft_proposer.attach_cache(num_blocks)
        if graphs:
            self.model_runner.capture_decode_graphs(self.config.scheduler_config.max_num_seqs, num_blocks)

    def uses_decode_graphs(self) -> bool:
        """CUDA graphs for decode steps: on CUDA, one rank (a graph cannot hold a step's collectives here), unless
        --enforce-eager; the graphs hold one block table, so not for a model with several KV cache groups."""
        return (self.device.type == "cuda" and not self.config.model_config.enforce_eager
                and self.config.parallel_config.world_size == 1 and len(self.kv_groups) == 1)

    def _attach_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.cache_engine = CacheEngine(self.config.model_config, self.config.cache_config, num_blocks, self.device,
                                        num_host_blocks, self.tensor_parallel_size, self.num_layers,
                                        self.layer_tensors)
        self.model_runner.kv_caches = self.cache_engine.kv_caches

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        """Run the step; None when its sampling waits for the grammar bitmask (then call `sample_tokens`); with
        async scheduling the output's tokens may still be on their way from the device."""
        # The order SchedulerOutput prescribes: a block evicted to the host this step may be reused by a swap-in
        # or a copy in the same step.
        self.cache_engine.swap_out(output.blocks_to_swap_out)
        self.cache_engine.swap_in(output.blocks_to_swap_in)
        if output.blocks_to_copy:
            self.cache_engine.copy_blocks(output.blocks_to_copy)
        if self.draft_proposer is None:
            return self.model_runner.execute_model(output)
        self.draft_proposer.copy_blocks(output.blocks_to_copy)
        output, self._step_drafts = self.draft_proposer.propose(output)
        return self._with_drafts(self.model_runner.execute_model(output))

    def sample_tokens(self, grammar: GrammarOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the step `execute_model` left waiting for its grammar bitmask."""
        return self._with_drafts(self.model_runner.sample_tokens(grammar))

    def _with_drafts(self, result: ModelRunnerOutput | AsyncModelRunnerOutput | None
                     ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        """The step's result with the drafts its draft model made (kept until the step samples)."""
        if result is not None and self._step_drafts:
            result.draft_token_ids, self._step_drafts = self._step_drafts, {}
        return result
