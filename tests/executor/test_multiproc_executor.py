"""The multi-process executor: the model in a worker process gives the in-process executor's tokens (structured
outputs included, whose bitmask reaches the worker in a second message), and a worker that dies is noticed at once
(generate raises, an AsyncLLM stops even when idle) with no process left behind."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from concurrent.futures import Future

import numpy as np
import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.sched.output import ScheduledRequest, SchedulerOutput
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.exceptions import EngineDeadError
from pagellm.sampling_params import BeamSearchParams, StructuredOutputsParams

MAX_MODEL_LEN = 256
REGEX = r"[a-z]{2,5}-[0-9]{2}"
CHOICES = ["apple pie", "banana", "cherry tart"]
REGEX_GREEDY = SamplingParams(temperature=0.0, max_tokens=24,
                              structured_outputs=StructuredOutputsParams(regex=REGEX))
CHOICE_SEEDED = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24,
                               structured_outputs=StructuredOutputsParams(choice=CHOICES))
FREE_SEEDED = SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)


def make_llm(model_dir, backend: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    return LLM(model=str(model_dir), distributed_executor_backend=backend, **kwargs)


def worker_pids(llm: LLM) -> list[int]:
    return [worker.process.pid for worker in llm.llm_engine.engine_core.executor.workers]


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited too
        return stat.read().split()[2] != "Z"



def fail_a_constrained_step(llm: LLM) -> None:
    """A constrained step whose forward pass fails (a sequence the worker never got) raises when collected; in a
    worker process its sampling call, already sent, fails too and must be read, or the next steps would get
    answers one step late."""
    executor = llm.llm_engine.engine_core.executor
    step = SchedulerOutput(scheduled=[ScheduledRequest("unknown", 1, 0)], structured_output_request_ids=["unknown"])
    bitmask: Future[np.ndarray] = Future()
    bitmask.set_result(np.full((1, 49152 // 32), -1, dtype=np.int32))
    executor.submit_model(step, bitmask)
    with pytest.raises(RuntimeError, match="no state for request unknown"):
        executor.collect_model_output()


def test_worker_process_gives_the_same_tokens_as_in_process(model_dir, make_token_prompts, pool_bytes):
    """Greedy, seeded n > 1, beam search, preemption (a small pool) and constrained sequences beside free ones,
    after a failed constrained step: every token equal, every constrained output valid."""
    prompts = make_token_prompts([5, 30, 60, 90], seed=3)
    runs = {}
    for backend in ("uni", "mp"):
        llm = make_llm(model_dir, backend, max_model_len=128, kv_cache_memory_bytes=pool_bytes(model_dir, 16, 10))
        fail_a_constrained_step(llm)
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                              use_tqdm=False)
        sampled = llm.generate(prompts[:2], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8),
                               use_tqdm=False)
        beams = llm.beam_search(prompts[:1], BeamSearchParams(beam_width=3, max_tokens=6))
        # Constrained and free sequences in one batch: the bitmask goes to the worker after the forward pass.
        constrained = llm.generate(prompts, [REGEX_GREEDY, FREE_SEEDED, CHOICE_SEEDED, REGEX_GREEDY], use_tqdm=False)
        runs[backend] = ([o.outputs[0].token_ids for o in greedy],
                         [[c.token_ids for c in o.outputs] for o in sampled],
                         [s.tokens for s in beams[0].sequences],
                         llm.llm_engine.engine_core.scheduler.num_preemptions_total,
                         [[(c.text, c.token_ids) for c in o.outputs] for o in constrained])
        llm.shutdown()
    assert runs["mp"] == runs["uni"]
    assert runs["mp"][3] > 0  # the small pool did preempt
    texts = [[text for text, _ in outputs] for outputs in runs["mp"][4]]
    assert all(re.fullmatch(REGEX, text) for text in texts[0] + texts[3])
    assert len(texts[2]) == 2 and set(texts[2]) <= set(CHOICES)


def test_a_killed_worker_fails_generate_fast_and_leaves_no_process(model_dir, make_token_prompts):
    llm = make_llm(model_dir, "mp")
    (pid,) = worker_pids(llm)
    prompts = make_token_prompts([20] * 4, seed=4)
    killed_at = None
    with pytest.raises(EngineDeadError, match="exited unexpectedly"):
        engine = llm.llm_engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        for step in range(1000):
            if step == 3:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
            engine.step()
    assert time.monotonic() - killed_at < 5.0
    assert not is_alive(pid)
    llm.shutdown()


def test_an_idle_async_engine_stops_when_its_worker_dies(model_dir):
    args = EngineArgs(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=8 << 20,
                      distributed_executor_backend="mp")
    async_llm = AsyncLLM.from_engine_args(args, log_stats=False)
    try:
        (pid,) = [w.process.pid for w in async_llm.client.core.executor.workers]
        assert async_llm.is_running
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while async_llm.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not async_llm.is_running

        async def submit():
            async for _ in async_llm.generate("hello", SamplingParams(max_tokens=2), "after"):
                pass

        with pytest.raises(EngineDeadError):
            asyncio.run(submit())
    finally:
        async_llm.shutdown()


def test_shutdown_and_garbage_collection_stop_the_workers(model_dir):
    llm = make_llm(model_dir, "mp")
    (pid,) = worker_pids(llm)
    llm.shutdown()
    assert not is_alive(pid)
    llm = make_llm(model_dir, "mp")
    (pid,) = worker_pids(llm)
    del llm
    import gc
    gc.collect()
    deadline = time.monotonic() + 5.0
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(pid)
