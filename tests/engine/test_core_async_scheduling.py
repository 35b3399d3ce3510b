"""The engine loop under `--async-scheduling` (tiny random Llama): a failure in batch N whose request already
continues in batch N+1 fails that request alone; a request that must wait for its results (bad words here) is
never left a step behind, the engine collecting first; the serving loop streams and aborts over it; the flag is
refused where it cannot work."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from engine_steps import step_until_done
from test_fault_isolation import PARAMS, fail_nth_call, fail_sampling_of, run, used_blocks

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> LLMEngine:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLMEngine.from_engine_args(EngineArgs(model=tiny_model_factory("llama"), max_model_len=128,
                                                kv_cache_memory_bytes=2 << 20, async_scheduling=True))
    torch.set_num_threads(previous)


def test_async_scheduling_picks_its_step_function_at_start(engine):
    assert engine.engine_core.step_fn.__name__ == "_step_async"


def record_batches(engine: LLMEngine, monkeypatch) -> list[tuple[int, list[str], int]]:
    """(batches in flight once submitted, request ids, sequences continuing blind) of every batch submitted."""
    core, batches = engine.engine_core, []
    submit = core.executor.submit_model

    def recording(output, bitmask=None):
        batches.append((len(core._in_flight) + 1, [s.request_id for s in output.scheduled],
                        sum(s.pending_token for s in output.scheduled)))
        return submit(output, bitmask)

    monkeypatch.setattr(core.executor, "submit_model", recording)
    return batches


def test_a_sampling_failure_fails_alone_while_its_next_step_is_in_flight(engine, monkeypatch):
    expected, failures = run(engine, PARAMS)
    assert not failures
    batches = record_batches(engine, monkeypatch)
    fail_sampling_of(monkeypatch, engine, "bad")
    tokens, failures = run(engine, PARAMS)
    assert list(failures) == ["bad"] and "injected sampling fault" in failures["bad"]
    expected.pop("bad")
    assert tokens == expected
    # "bad" was already in the next batch, continuing blind, when its sampling failed.
    assert any(depth == 2 and "bad" in request_ids for depth, request_ids, _ in batches)
    assert used_blocks(engine) == 0 and not engine.engine_core.scheduler.in_flight
    engine.engine_core.scheduler.check_consistency()


def test_a_failed_step_fails_its_requests_and_their_blind_next_step_reads_no_stale_token(engine, monkeypatch):
    """The forward pass of one step raises after its inputs were prepared; the next step, already submitted with
    that request continuing blind, finds no sampled token for it (none is left over from earlier steps) and fails
    it too; the request waiting behind it then runs as it would have."""
    expected, _ = run(engine, ["greedy", "seeded"])
    fail_nth_call(monkeypatch, engine.engine_core.executor.worker.model_runner, "_forward")
    monkeypatch.setattr(engine.engine_core.scheduler.config, "max_num_seqs", 1)  # "seeded" waits behind "greedy"
    batches = record_batches(engine, monkeypatch)
    executor, results = engine.engine_core.executor, []
    collect = executor.collect_model_output

    def recording_collect():
        try:
            results.append(collect())
        except RuntimeError as exc:
            results.append(exc)
            raise
        return results[-1]

    monkeypatch.setattr(executor, "collect_model_output", recording_collect)
    tokens, failures = run(engine, ["greedy", "seeded"])
    assert list(failures) == ["greedy"] and "injected device error" in failures["greedy"]
    assert tokens == {"seeded": expected["seeded"]}
    assert batches[3] == (2, ["greedy"], 1)  # submitted while the failing third batch was still uncollected
    assert isinstance(results[2], RuntimeError)
    assert "sampled no token" in results[3].failed["greedy"] and not results[3].sampled_token_ids
    assert used_blocks(engine) == 0 and not engine.engine_core.scheduler.in_flight
    engine.engine_core.scheduler.check_consistency()


def test_a_request_that_must_wait_for_its_token_is_never_left_behind(engine, monkeypatch):
    batches = record_batches(engine, monkeypatch)
    engine.add_request("plain", "Once upon a time", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("bad_words", "Once upon a time", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                       bad_words=["dragon"]))
    _, failures = run(engine, [])
    assert not failures
    # Both in every batch, one batch per token: the engine collected each batch before scheduling the next.
    assert [request_ids for _, request_ids, _ in batches] == [["plain", "bad_words"]] * 8
    assert {depth for depth, _, _ in batches} == {1}


def test_async_llm_streams_and_aborts(engine):
    """The serving loop over an async-scheduling engine: concurrent streams add up to the offline result, an abort
    while the request's next step is already submitted ends its stream, and every block comes back."""
    from pagellm.engine.async_llm import AsyncLLM

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ref-{i}", prompt, greedy)
    expected, _ = step_until_done(engine)
    llm = AsyncLLM.from_engine(engine, log_stats=False)

    async def collect(i: int) -> list[int]:
        token_ids = []
        async for output in llm.generate(prompts[i], greedy, f"stream-{i}"):
            token_ids += output.outputs[0].token_ids
        return token_ids

    async def aborted() -> list:
        outputs = []
        async for output in llm.generate("Tell me a long story", SamplingParams(max_tokens=200, ignore_eos=True),
                                         "abort-me"):
            outputs.append(output)
            if len(outputs) == 2:
                await llm.abort("abort-me")
        return outputs

    async def run():
        return await asyncio.gather(aborted(), *(collect(i) for i in range(len(prompts))))

    try:
        aborted_outputs, *streams = asyncio.run(run())
        deadline = time.monotonic() + 10
        while used_blocks(engine) and time.monotonic() < deadline:  # the engine thread applies the abort
            time.sleep(0.01)
    finally:
        llm.shutdown()
    assert streams == [expected[f"ref-{i}"].outputs[0].token_ids for i in range(len(prompts))]
    assert 2 <= len(aborted_outputs) < 200 and not aborted_outputs[-1].finished
    assert used_blocks(engine) == 0 and not engine.engine_core.scheduler.in_flight


def test_async_scheduling_needs_one_rank_in_this_process(tiny_model_factory):
    args = EngineArgs(model=tiny_model_factory("llama"), async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--async-scheduling works with one rank"):
        args.create_engine_config()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_submitting_a_step_never_waits_for_the_gpu(tiny_model_factory):
    """What makes async scheduling overlap on a GPU: preparing, launching and sampling a step (greedy and seeded
    sampling, top-k/top-p, logit bias, penalties, a grammar) never synchronizes with the device; only collecting a
    step's tokens does."""
    from pagellm import LLM
    from pagellm.sampling_params import StructuredOutputsParams

    llm = LLM(model=str(tiny_model_factory("llama")), device="cuda", max_model_len=128, async_scheduling=True,
              kv_cache_memory_bytes=16 << 20)
    executor = llm.llm_engine.engine_core.executor

    def strict(call):
        def wrapped(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return call(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return wrapped

    for name in ("submit_model", "submit_forward", "sample_submitted"):
        setattr(executor, name, strict(getattr(executor, name)))
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True,
                             logit_bias={5: 2.0}, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
                  regex="[a-z]{20}"))]
    outputs = llm.generate([{"prompt_token_ids": list(range(20, 60))}] * 3, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs][:2] == [12, 12] and outputs[2].outputs[0].text.isalpha()
