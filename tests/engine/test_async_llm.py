"""AsyncLLM over a tiny random-weight model: delta outputs add up to the synchronous engine's greedy result,
bad input fails before anything is yielded, and cancelling, aborting, a failing engine and shutdown all end the
streams and free every KV block."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.llm_engine import LLMEngine
from pagellm.exceptions import EngineDeadError
from pagellm.metrics.stats import IterationStats, StatLoggerBase
from pagellm.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


class _Recorder(StatLoggerBase):
    def __init__(self) -> None:
        self.finish_reasons: list[str] = []
        self.num_generation_tokens = 0

    def record(self, iteration: IterationStats) -> None:
        self.finish_reasons += [f.finish_reason for f in iteration.finished_requests]
        self.num_generation_tokens += iteration.num_generation_tokens


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> LLMEngine:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny steps: one thread is fastest on the shared test machine
    yield LLMEngine.from_engine_args(EngineArgs(model=tiny_model_factory("llama"), max_model_len=256,
                                                kv_cache_memory_bytes=2 << 20))
    torch.set_num_threads(previous)


@pytest.fixture
def async_llm(engine):
    """A fresh AsyncLLM (engine thread) over the shared engine, shut down after the test."""
    llm = AsyncLLM.from_engine(engine, log_stats=False)
    yield llm
    llm.shutdown()


def used_blocks(engine: LLMEngine) -> int:
    return engine.engine_core.kv_cache_manager.block_pool.num_used_blocks


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def reference(engine: LLMEngine, params: SamplingParams) -> list[tuple[str, list[int]]]:
    """The synchronous engine's results (run before any AsyncLLM thread owns the engine)."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ref-{i}", prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step()[0]:
            results[output.request_id] = (output.outputs[0].text, output.outputs[0].token_ids)
    return [results[f"ref-{i}"] for i in range(len(PROMPTS))]


def test_deltas_add_up_to_the_engine_result(engine):
    expected = reference(engine, GREEDY)
    llm = AsyncLLM.from_engine(engine, log_stats=False)
    recorder = _Recorder()
    llm.add_stat_logger(recorder)

    async def collect(i: int) -> tuple[str, list[int], int]:
        text, token_ids, num_logprobs, outputs = "", [], 0, []
        async for output in llm.generate(PROMPTS[i], GREEDY, f"req-{i}"):
            outputs.append(output)
            (completion,) = output.outputs
            text += completion.text
            token_ids += completion.token_ids
            num_logprobs += len(completion.logprobs)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        assert not any(o.finished for o in outputs[:-1])
        return text, token_ids, num_logprobs

    async def run():
        return await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))

    try:
        results = asyncio.run(run())
    finally:
        llm.shutdown()
    assert [(text, ids) for text, ids, _ in results] == expected
    assert all(num_logprobs == 12 for _, _, num_logprobs in results)
    assert recorder.finish_reasons == ["length"] * len(PROMPTS)
    assert recorder.num_generation_tokens == 12 * len(PROMPTS)
    assert used_blocks(engine) == 0


def test_bad_input_raises_before_any_output(async_llm, engine):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in async_llm.generate({"prompt_token_ids": [5] * 300}, GREEDY, "too-long"):
                pytest.fail("an output was yielded")
        # The engine keeps serving.
        outputs = [o async for o in async_llm.generate("Hello", GREEDY, "fine")]
        return outputs[-1]

    assert asyncio.run(run()).finished
    assert used_blocks(engine) == 0


def test_cancelled_consumer_aborts_and_frees_blocks(async_llm, engine):
    recorder = _Recorder()
    async_llm.add_stat_logger(recorder)

    async def run():
        seen = asyncio.Event()

        async def consume():
            async for _ in async_llm.generate("Tell me a long story", LONG, "cancel-me"):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        assert used_blocks(engine) > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    wait_for(lambda: used_blocks(engine) == 0 and async_llm.get_scheduler_stats().num_running == 0)
    assert recorder.finish_reasons == ["abort"]
    assert recorder.num_generation_tokens < 200


def test_abort_ends_the_stream(async_llm, engine):
    async def run():
        outputs = []
        async for output in async_llm.generate("Tell me a long story", LONG, "abort-me"):
            outputs.append(output)
            if len(outputs) == 2:
                await async_llm.abort("abort-me")
        return outputs

    outputs = asyncio.run(run())
    assert 2 <= len(outputs) < 200 and not outputs[-1].finished
    wait_for(lambda: used_blocks(engine) == 0)


def test_engine_failure_fails_every_request(engine, monkeypatch):
    llm = AsyncLLM.from_engine(engine, log_stats=False)

    def broken_step():
        raise RuntimeError("simulated device failure")

    async def run():
        started = [asyncio.Event() for _ in PROMPTS]

        async def consume(i: int):
            async for _ in llm.generate(PROMPTS[i], LONG, f"doomed-{i}"):
                started[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(len(PROMPTS))]
        for event in started:
            await event.wait()
        monkeypatch.setattr(engine.engine_core, "step", broken_step)
        for task in tasks:
            with pytest.raises(EngineDeadError, match="internal error"):
                await task
        with pytest.raises(EngineDeadError):
            await anext(llm.generate("Hello", GREEDY, "too-late"))

    try:
        asyncio.run(run())
        assert not llm.is_running
    finally:
        llm.shutdown()
    assert used_blocks(engine) == 0 and not engine.has_unfinished_requests()


def test_shutdown_fails_requests_in_flight(engine):
    llm = AsyncLLM.from_engine(engine, log_stats=False)

    async def run():
        stream = llm.generate("Tell me a long story", LONG, "in-flight")
        await anext(stream)
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass

    asyncio.run(run())
    assert not llm.is_running
    assert used_blocks(engine) == 0 and not engine.has_unfinished_requests()


def test_the_engine_thread_builds_the_core_it_steps(tiny_model_factory, monkeypatch):
    """The model is loaded, and every step runs, on the loop's one thread (core_loop.py): a second OpenMP pool on
    another thread made each kernel call wait for parked workers (2.2x slower decode steps)."""
    import threading

    from pagellm.engine.core import EngineCore

    threads: dict[str, set[str]] = {"build": set(), "step": set()}
    build, step = EngineCore.__init__, EngineCore.step

    def recording_build(self, *args, **kwargs):
        threads["build"].add(threading.current_thread().name)
        build(self, *args, **kwargs)

    def recording_step(self):
        threads["step"].add(threading.current_thread().name)
        return step(self)

    monkeypatch.setattr(EngineCore, "__init__", recording_build)
    monkeypatch.setattr(EngineCore, "step", recording_step)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model_factory("llama"), max_model_len=64,
                                                  kv_cache_memory_bytes=4 << 20), log_stats=False)
    try:
        async def run() -> None:
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            async for _ in engine.generate({"prompt_token_ids": [1, 2, 3]}, params, "r"):
                pass

        asyncio.run(run())
    finally:
        engine.shutdown()
    assert threads == {"build": {"pagellm-engine"}, "step": {"pagellm-engine"}}
