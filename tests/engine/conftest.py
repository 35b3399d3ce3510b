"""Fixtures shared by the engine tests."""
from __future__ import annotations

import pytest
import torch

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def one_thread_engine(tiny_model_factory) -> LLMEngine:
    """A tiny Llama engine (one per test module) stepping on one thread, so results do not depend on how the
    process's threads are scheduled."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLMEngine.from_engine_args(EngineArgs(model=tiny_model_factory("llama"), max_model_len=128,
                                                kv_cache_memory_bytes=2 << 20))
    torch.set_num_threads(previous)
