"""The decode steps profiled when an engine with a latency target starts (engine/step_profile.py): the scheduler's
step-time model holds the ladder's batch sizes up to the first slower than the target (or max_num_seqs), the
workers keep nothing of the throwaway sequences, and the engine then gives the same greedy tokens as one without a
target."""
from __future__ import annotations

from engine_steps import step_until_done

from pagellm import SamplingParams
from pagellm.core.sched.step_time import COLD_STEPS
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.step_profile import LADDER, REPEATS


def engine(model, **overrides) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=model, max_model_len=128, kv_cache_memory_bytes=8 << 20,
                                                 **overrides))


def greedy_tokens(llm: LLMEngine) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(6):
        llm.add_request(f"r{i}", {"prompt_token_ids": list(range(100 + 7 * i, 120 + 11 * i))}, params)
    outputs, failures = step_until_done(llm)
    assert not failures
    return {request_id: output.outputs[0].token_ids for request_id, output in outputs.items()}


def test_the_profile_seeds_the_model_and_leaves_the_engine_as_it_was(tiny_model_factory):
    model = tiny_model_factory("llama")
    profiled = engine(model, max_num_seqs=24, target_tpot_ms=1e4)
    core = profiled.engine_core
    assert core.scheduler.planner.limiter.model.rows_seen == [rows for rows in LADDER if rows <= 24]
    assert not core.executor.worker.model_runner.input_batch.requests  # the profile's sequences are gone
    assert greedy_tokens(profiled) == greedy_tokens(engine(model, max_num_seqs=24))


def test_the_profile_stops_at_the_first_batch_slower_than_the_target(tiny_model_factory):
    core = engine(tiny_model_factory("llama"), max_num_seqs=24, target_tpot_ms=1e-3).engine_core
    assert REPEATS > COLD_STEPS  # one step of the first size is observed
    assert core.scheduler.planner.limiter.model.rows_seen == [1]
