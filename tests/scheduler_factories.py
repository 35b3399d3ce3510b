"""Factories for the scheduler's tests (vLLM: tests/v1/core/utils.py): requests and schedulers with small defaults.

tests/ is on sys.path (its conftest.py sits there), so any test imports them as `from scheduler_factories import
...`; the name is unique, unlike `conftest`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagellm.config import SchedulerConfig
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.core.sched.scheduler import Scheduler
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.manager import StructuredOutputManager

EOS = 2
TOKEN = 7  # what a fake model samples unless told otherwise: never EOS, never a prompt token


def make_request(request_id: str = "r", prompt: int | list[int] = 4, max_tokens: int = 16, *,
                 params: SamplingParams | None = None, eos_token_ids: Iterable[int] = (EOS,), priority: int = 0,
                 arrival_time: float | None = None, **sampling: Any) -> Request:
    """A Request. `prompt`: its token ids, or how many (ids 100, 101, ...: distinct from the tokens tests sample).
    `params`: its sampling parameters (it takes their max_tokens); else greedy ones with `max_tokens` and the
    `sampling` fields (n, ignore_eos, stop_token_ids, logprobs, ...)."""
    if params is None:
        params = SamplingParams(**{"temperature": 0.0, **sampling}, max_tokens=max_tokens)
    else:
        assert not sampling, "give either params or their fields"
    prompt_token_ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    request = Request(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=params,
                      eos_token_ids=frozenset(eos_token_ids), max_tokens=params.max_tokens, priority=priority)
    if arrival_time is not None:
        request.arrival_time = arrival_time
    return request


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = False,
                   num_host_blocks: int = 0, max_model_len: int = 64, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, structured_output_manager: StructuredOutputManager | None = None,
                   **config: Any) -> Scheduler:
    """A Scheduler over a KV pool of `num_blocks` blocks (and a host tier of `num_host_blocks`); `config`: the
    other SchedulerConfig fields (scheduling_policy, enable_chunked_prefill, async_scheduling, ...)."""
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       **config)
    scheduler_config.check_fits(max_model_len)
    kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                                      num_host_blocks=num_host_blocks)
    return Scheduler(scheduler_config, max_model_len, kv_cache_manager, structured_output_manager)


def compute(kv: KVCacheManager, request: Request, num_new: int) -> None:
    """Allocate and mark `num_new` tokens computed, as a step does (past the prompt: tokens sampled before)."""
    while request.num_tokens < request.num_computed_tokens + num_new:
        request.append_output_token(1000 + request.num_tokens)
    assert kv.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new
    kv.cache_full_blocks(request)
    kv.finish_step()
