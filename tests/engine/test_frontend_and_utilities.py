"""One front end, one step function, one generic command: `AsyncLLM.from_engine` reuses the engine's front end
(no second tokenizer or processors), EngineCore picks its step function once by mode, commands beyond add and abort
run as `@utility` methods by name (and only those), and a beam search served by AsyncLLM gives what the offline
engine gives."""
from __future__ import annotations

import asyncio

import pytest
import torch

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.llm_engine import LLMEngine
from pagellm.exceptions import EngineDeadError, InvalidRequestError
from pagellm.sampling_params import BeamSearchParams, SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 17, 300, 42, 9]}, "The capital of France is"]
BEAMS = BeamSearchParams(beam_width=3, max_tokens=6)


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> LLMEngine:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLMEngine.from_engine_args(EngineArgs(model=tiny_model_factory("llama"), max_model_len=128,
                                                kv_cache_memory_bytes=2 << 20))
    torch.set_num_threads(previous)


def offline_beam_search(engine: LLMEngine, prompt, params: BeamSearchParams):
    engine.add_beam_search_request("offline", prompt, params)
    results = []
    while engine.has_unfinished_requests():
        results += engine.step()[0]
    (result,) = results
    return [(s.tokens, s.text, s.finish_reason) for s in result.sequences]


def test_async_llm_shares_the_engine_front_end(engine):
    llm = AsyncLLM.from_engine(engine, log_stats=False)
    try:
        assert llm.frontend is engine.frontend
        assert engine.tokenizer is engine.frontend.tokenizer is engine.input_processor.tokenizer
    finally:
        llm.shutdown()


def test_step_function_is_chosen_once_by_mode(engine):
    core = engine.engine_core
    assert not core.async_scheduling and core.num_stages == 1
    assert core.step_fn.__name__ == "_step_sync"


def test_only_marked_methods_are_utilities(engine):
    core = engine.engine_core
    assert engine.call_utility("engine_state")["device"]["num_blocks"] == core.num_blocks
    for name in ("shutdown", "add_request", "step", "_collect", "no_such_method"):
        with pytest.raises(ValueError, match="not an engine utility"):
            engine.call_utility(name)


def test_async_utility_calls(engine):
    llm = AsyncLLM.from_engine(engine, log_stats=False)

    async def main() -> None:
        state = await llm.call_utility("engine_state")
        assert state == await llm.get_engine_state()
        with pytest.raises(ValueError, match="not an engine utility"):
            await llm.call_utility("shutdown")
        with pytest.raises(InvalidRequestError):
            await llm.call_utility("engine_state", engine_index=1)
        llm.shutdown()
        with pytest.raises(EngineDeadError):
            await llm.call_utility("engine_state")

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_served_beam_search_matches_the_offline_engine(engine, prompt):
    expected = offline_beam_search(engine, prompt, BEAMS)
    llm = AsyncLLM.from_engine(engine, log_stats=False)

    async def main():
        # Run two at once next to a plain request: each gets its own beams.
        async def search(request_id: str):
            return [output async for output in llm.beam_search(prompt, BEAMS, request_id)]

        async def plain():
            return [o async for o in llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0), "plain")]

        return await asyncio.gather(search("a"), search("b"), plain())

    try:
        first, second, plain_outputs = asyncio.run(main())
    finally:
        llm.shutdown()
    assert plain_outputs[-1].finished
    for outputs, request_id in ((first, "a"), (second, "b")):
        (output,) = outputs
        assert output.request_id == request_id
        assert [(s.tokens, s.text, s.finish_reason) for s in output.sequences] == expected
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_served_beam_search_bad_input_and_abort(engine):
    llm = AsyncLLM.from_engine(engine, log_stats=False)

    async def main() -> None:
        with pytest.raises(InvalidRequestError, match="beam_width"):
            async for _ in llm.beam_search("Hello", BeamSearchParams(beam_width=10_000, max_tokens=4), "too-wide"):
                pass
        long = BeamSearchParams(beam_width=2, max_tokens=100, ignore_eos=True)
        task = asyncio.ensure_future(_drain(llm.beam_search("Once upon a time", long, "cancelled")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
        deadline = asyncio.run(_wait_idle(engine))
        assert deadline, "the cancelled beam search kept its KV blocks"
    finally:
        llm.shutdown()


async def _drain(iterator) -> list:
    return [item async for item in iterator]


async def _wait_idle(engine: LLMEngine, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0:
            return True
        await asyncio.sleep(0.01)
    return False
