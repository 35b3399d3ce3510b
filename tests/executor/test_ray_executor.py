"""The Ray executor on a local Ray instance started by the test: two tensor-parallel ranks as actors give the
multi-process executor's tokens (structured outputs included), and a killed actor fails the engine fast."""
from __future__ import annotations

import re
import time

import pytest
import ray  # in the test extras

from pagellm import LLM, SamplingParams
from pagellm.exceptions import EngineDeadError
from pagellm.sampling_params import StructuredOutputsParams

REGEX = r"[a-z]{2,5}-[0-9]{2}"


@pytest.fixture(scope="module")
def local_ray():
    # Two CPUs' worth of actor slots, whatever the machine: one per rank. Bounded: nothing is left running.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_two_ray_ranks_equal_two_worker_processes(local_ray, tiny_model_factory, make_token_prompts):
    model_dir = tiny_model_factory("llama")
    prompts = make_token_prompts([9, 33], seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # The output rank samples this one in a second call, once the bitmask computed meanwhile is there.
    constrained = SamplingParams(temperature=0.0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(regex=REGEX))
    tokens = {}
    for backend in ("mp", "ray"):
        llm = LLM(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2,
                  distributed_executor_backend=backend)
        outputs = llm.generate(prompts + prompts[:1], [params, params, constrained], use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
        assert re.fullmatch(REGEX, outputs[2].outputs[0].text)
        if backend == "ray":
            executor = llm.llm_engine.engine_core.executor
            ray.kill(executor.actors[1])
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                while time.monotonic() - start < 10:
                    llm.generate(prompts[:1], params, use_tqdm=False)
            assert time.monotonic() - start < 5.0
        llm.shutdown()
    assert tokens["ray"] == tokens["mp"]
