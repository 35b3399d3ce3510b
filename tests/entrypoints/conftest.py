"""Shared helpers for the offline-API tests: an unbatched Hugging Face greedy reference and small utilities."""
from __future__ import annotations

import contextlib

import pytest
import torch


@contextlib.contextmanager
def single_thread():
    """Run the reference with one intra-op thread: on a small shared CPU box, oversubscribed torch threads make
    transformers' decode loop several times slower (results do not depend on it beyond float noise)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def hf_greedy_generate(model, prompt_token_ids: list[int], max_new_tokens: int,
                       eos_token_id: int | list[int] | None = None) -> list[int]:
    """Greedy continuation of one prompt (unbatched, no padding) with transformers.

    eos_token_id=None disables stopping entirely, which is what `SamplingParams(ignore_eos=True)` does on our
    side: the EOS token may still be *generated*, it just does not end the sequence. (`min_new_tokens` would not
    be equivalent: it masks EOS out of the logits.) The model's own generation config is swapped for a blank one
    so that its eos/pad ids and any sampling defaults cannot leak into the reference.
    """
    from transformers import GenerationConfig

    ids = torch.tensor([prompt_token_ids], dtype=torch.long)
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        with single_thread(), torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=eos_token_id,
                                 pad_token_id=0, num_beams=1, repetition_penalty=1.0)
    finally:
        model.generation_config = saved
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """These tests run many small forward passes. On the shared 2-core test machine, two OpenMP threads that
    compete with other processes spin-wait and made the engine 10-50x slower than one thread (measured), so
    every module here runs single-threaded; the previous setting is restored afterwards."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def hf_model(model_dir):
    """transformers' float32 model of the test module's `model_dir` checkpoint (the independent reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy():
    return hf_greedy_generate


def assert_no_leaked_blocks(llm) -> None:
    core = llm.llm_engine.engine_core
    pool = core.kv_cache_manager.block_pool
    assert not core.scheduler.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks, (
        f"{pool.num_blocks - pool.num_free_blocks} KV blocks still held after every request finished")
    assert not core.kv_cache_manager.req_to_blocks
    host_pool = core.kv_cache_manager.host_pool
    if host_pool is not None:
        assert host_pool.num_free_blocks == host_pool.num_blocks, "host-tier blocks still held"
    core.scheduler.check_consistency()


@pytest.fixture(scope="session")
def no_leaks():
    return assert_no_leaked_blocks


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="session")
def token_ids_of():
    return tokens_of
