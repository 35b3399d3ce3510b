"""The worker's side of the host tier: how many host blocks swap_space buys (capped when the host lacks the
memory), and execute_model applying swap-out, swap-in and copies in that order before the forward pass."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagellm.config import CacheConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagellm.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
from pagellm.engine.arg_utils import EngineArgs
from pagellm.executor.uniproc_executor import UniProcExecutor
from pagellm.sampling_params import SamplingParams
from pagellm.worker import worker as worker_module
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.model_runner import ModelRunnerOutput
from pagellm.worker.worker import Worker

GiB = 1 << 30


def make_worker(swap_space_bytes: int = 0, dtype: torch.dtype = torch.bfloat16, cache_dtype: str = "auto") -> Worker:
    """A worker over a model config alone (no weights): enough for sizing and for the cache."""
    hf_config = SimpleNamespace(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, hidden_size=256)
    model_config = ModelConfig(model="none", tokenizer="none", hf_config=hf_config, architecture="LlamaForCausalLM",
                               dtype=dtype, max_model_len=64, max_logprobs=0)
    cache_config = CacheConfig(block_size=16, swap_space_bytes=swap_space_bytes, cache_dtype=cache_dtype)
    config = SimpleNamespace(model_config=model_config, cache_config=cache_config,
                             scheduler_config=SchedulerConfig(),
                             device_config=SimpleNamespace(device=torch.device("cpu")),
                             parallel_config=ParallelConfig(), lora_config=LoRAConfig())
    return Worker(config)


def bytes_per_block(worker: Worker) -> int:
    """Measured on a one-block cache, independently of kv_bytes_per_block."""
    cache = CacheEngine(worker.config.model_config, worker.config.cache_config, 1, torch.device("cpu"))
    return sum(kv.numel() * kv.element_size() for kv in cache.kv_caches)


@pytest.mark.parametrize("dtype,cache_dtype,element_size", [
    (torch.bfloat16, "auto", 2), (torch.float32, "auto", 4), (torch.float32, "float16", 2),
    (torch.float32, "bfloat16", 2), (torch.bfloat16, "float32", 4), (torch.float32, "fp8", 1),
    (torch.bfloat16, "fp8_e5m2", 1)])
def test_host_blocks_are_swap_space_over_block_bytes(monkeypatch, dtype, cache_dtype, element_size):
    monkeypatch.setattr(worker_module, "available_host_memory", lambda: 64 * GiB)
    worker = make_worker(swap_space_bytes=GiB + 12345, dtype=dtype, cache_dtype=cache_dtype)
    # 2 (K and V) * 3 layers * 16 tokens * 2 kv heads * 32 head dim (256 / 8) * element size.
    assert bytes_per_block(worker) == 2 * 3 * 16 * 2 * 32 * element_size
    assert worker._kv_bytes_per_block() == bytes_per_block(worker)
    assert worker.determine_num_host_blocks() == (GiB + 12345) // bytes_per_block(worker)


def test_no_swap_space_means_no_host_blocks():
    assert make_worker(swap_space_bytes=0).determine_num_host_blocks() == 0


def test_swap_space_beyond_half_the_free_host_memory_is_capped_with_a_warning(monkeypatch):
    warnings: list[tuple] = []
    monkeypatch.setattr(worker_module, "available_host_memory", lambda: 2 * GiB)
    monkeypatch.setattr(worker_module.logger, "warning", lambda *args: warnings.append(args))
    worker = make_worker(swap_space_bytes=4 * GiB)
    assert worker.determine_num_host_blocks() == GiB // bytes_per_block(worker)
    assert len(warnings) == 1 and "--swap-space" in warnings[0][0]


@pytest.mark.parametrize("cache_dtype", ["auto", "float16", "fp8"])
def test_execute_model_swaps_out_then_in_then_copies_before_the_forward(monkeypatch, cache_dtype, same_bytes):
    worker = make_worker(dtype=torch.float32, cache_dtype=cache_dtype)
    worker.initialize_cache(num_blocks=4, num_host_blocks=3)
    cache = worker.cache_engine
    generator = torch.Generator().manual_seed(0)
    for kv in cache.kv_caches + cache.host_caches:
        kv.copy_(torch.randn(kv.shape, generator=generator))
    device_before = [kv.clone() for kv in cache.kv_caches]
    host_before = [kv.clone() for kv in cache.host_caches]
    seen: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def forward(output: SchedulerOutput) -> ModelRunnerOutput:
        device = [kv.clone() for kv in worker.model_runner.kv_caches]
        seen.append((device, [kv.clone() for kv in cache.host_caches]))
        return ModelRunnerOutput({})

    monkeypatch.setattr(worker.model_runner, "execute_model", forward)
    # Device block 2 is evicted to host block 0 and reused for host block 1, whose contents are then copied to
    # device block 3. Any other order leaves a different block somewhere.
    worker.execute_model(SchedulerOutput(blocks_to_swap_out=[(2, 0)], blocks_to_swap_in=[(1, 2)],
                                         blocks_to_copy=[(2, 3)]))
    [(device, host)] = seen
    for kv, host_kv, old_kv, old_host in zip(device, host, device_before, host_before):
        assert same_bytes(host_kv[:, :, 0], old_kv[:, :, 2])
        assert same_bytes(kv[:, :, 2], old_host[:, :, 1])
        assert same_bytes(kv[:, :, 3], old_host[:, :, 1])
        assert same_bytes(kv[:, :, :2], old_kv[:, :, :2])


def test_profile_run_still_uses_a_throwaway_cache_without_host_blocks(monkeypatch):
    worker = make_worker(swap_space_bytes=GiB)
    worker.config.scheduler_config = SchedulerConfig(max_num_batched_tokens=40)
    worker.config.model_config.max_model_len = 32
    caches: list[CacheEngine] = []

    def forward(output: SchedulerOutput) -> ModelRunnerOutput:
        caches.append(worker.cache_engine)
        return ModelRunnerOutput({})

    monkeypatch.setattr(worker.model_runner, "execute_model", forward)
    worker.profile_run()
    [cache] = caches
    assert cache.num_blocks == 3 and cache.host_caches == []  # 32 + 8 tokens in 16-token blocks
    assert worker.cache_engine is None


@pytest.fixture(scope="module")
def executor(tiny_model_factory) -> UniProcExecutor:
    args = EngineArgs(model=tiny_model_factory("llama"), max_model_len=64, block_size=16, swap_space=1 / 1024)
    return UniProcExecutor(args.create_engine_config())


def test_the_executor_sizes_and_builds_the_host_tier(executor):
    num_host_blocks = executor.determine_num_host_blocks()
    executor.initialize_cache(2, num_host_blocks)
    cache = executor.worker.cache_engine
    block_bytes = sum(kv[:, :, 0].numel() * kv.element_size() for kv in cache.kv_caches)
    assert num_host_blocks == (1 << 20) // block_bytes  # swap_space=1/1024 GiB
    assert cache.num_host_blocks == num_host_blocks and len(cache.host_caches) == len(cache.kv_caches)


def greedy_step(request_id: str, prompt: list[int], output: list[int], block_ids: list[int],
                **moves: list[tuple[int, int]]) -> SchedulerOutput:
    """Prefill `prompt` (while there is no output yet) or decode the last output token, greedily with logprobs."""
    num_tokens, computed = (1, len(prompt) + len(output) - 1) if output else (len(prompt), 0)
    new = NewRequestData(request_id, prompt, output, SamplingParams(temperature=0.0, logprobs=5))
    scheduled = ScheduledRequest(request_id, num_tokens, computed, [], block_ids, replaces_block_table=True)
    return SchedulerOutput(new_requests=[new], scheduled=[scheduled], **moves)


def test_a_request_swapped_out_and_back_into_other_blocks_decodes_as_if_it_never_left(executor):
    prompt = list(range(100, 120))  # 20 tokens: two 16-token blocks
    executor.initialize_cache(8, 4)
    first = executor.execute_model(greedy_step("reference", prompt, [], [0, 1]))
    [token] = first.sampled_token_ids["reference"]
    expected = executor.execute_model(greedy_step("reference", prompt, [token], [0, 1]))

    executor.initialize_cache(8, 4)
    executor.execute_model(greedy_step("swapped", prompt, [], [0, 1]))
    executor.execute_model(SchedulerOutput(blocks_to_swap_out=[(0, 3), (1, 0)]))
    for kv in executor.worker.cache_engine.kv_caches:
        kv[:, :, :2].normal_()  # blocks 0 and 1 now hold another request's K/V
    # The blocks come back into device blocks 5 and 2 in the same step that decodes from them.
    got = executor.execute_model(greedy_step("swapped", prompt, [token], [5, 2], blocks_to_swap_in=[(3, 5), (0, 2)]))
    assert got.sampled_token_ids["swapped"] == expected.sampled_token_ids["reference"]
    assert got.logprobs["swapped"] == expected.logprobs["reference"]
