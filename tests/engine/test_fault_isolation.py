"""Fault isolation in the engine, over a tiny random-weight model, with failures injected by wrapping the real
code paths: a request whose sampling, prompt logprobs or output building raises fails alone (RequestFailedError
naming it, its blocks freed) while the others produce exactly the tokens they produce without the fault, seeded
ones included; a step that fails as a whole fails only the requests it held; repeated whole-step failures stop
the engine."""
from __future__ import annotations

import asyncio

import pytest
from engine_steps import step_until_done

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.core import MAX_CONSECUTIVE_FAILED_STEPS
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.llm import LLM
from pagellm.exceptions import RequestFailedError
from pagellm.sampling_params import SamplingParams
from pagellm.worker import isolated_outputs

PROMPTS = {"greedy": "The capital of France is", "seeded": "Once upon a time", "bad": "def fibonacci(n):",
           "other": "1, 2, 3, 4,"}
PARAMS = {"greedy": SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          "seeded": SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True, logprobs=2),
          "bad": SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True),
          "other": SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=10, ignore_eos=True)}


@pytest.fixture(scope="module")
def engine(one_thread_engine) -> LLMEngine:
    return one_thread_engine


def runner(engine: LLMEngine):
    return engine.engine_core.executor.worker.model_runner


def used_blocks(engine: LLMEngine) -> int:
    return engine.engine_core.kv_cache_manager.block_pool.num_used_blocks


def fail_sampling_of(monkeypatch, engine: LLMEngine, group_id: str, from_sample: int = 3) -> None:
    """Make sampling raise for every batch that holds one of `group_id`'s sequences, from its `from_sample`-th
    sample on, after the batch has drawn its random numbers (so the retry must draw the other requests' seeded
    numbers again, the same: they come from each seed and output position)."""
    sampler = runner(engine).batch_sampler
    sample_rows = sampler.sample_rows
    batches = []

    def faulty(logits, requests, rows, *rest):
        result = sample_rows(logits, requests, rows, *rest)
        if any(requests[row].request_id.split("/")[0] == group_id for row in rows):
            batches.append(rows)
            if len(batches) >= from_sample:
                raise RuntimeError(f"injected sampling fault for {group_id}")
        return result

    monkeypatch.setattr(sampler, "sample_rows", faulty)


def fail_nth_call(monkeypatch, owner, name: str, n: int = 3) -> list:
    """Make `owner.name` raise RuntimeError("injected device error") on its n-th call; returns the first argument
    of every call."""
    call, seen = getattr(owner, name), []

    def failing(first, *rest):
        seen.append(first)
        if len(seen) == n:
            raise RuntimeError("injected device error")
        return call(first, *rest)

    monkeypatch.setattr(owner, name, failing)
    return seen


def run(engine: LLMEngine, names) -> tuple[dict[str, list[list[int]]], dict[str, str]]:
    """Add the named requests, step until done; returns (token ids of each finished sequence, failures)."""
    for name in names:
        engine.add_request(name, PROMPTS[name], PARAMS[name])
    outputs, failures = step_until_done(engine)
    return {request_id: [c.token_ids for c in output.outputs] for request_id, output in outputs.items()}, failures


def test_a_request_whose_sampling_fails_fails_alone(engine, monkeypatch):
    expected, failures = run(engine, PARAMS)
    assert not failures
    fail_sampling_of(monkeypatch, engine, "bad")
    tokens, failures = run(engine, PARAMS)
    assert list(failures) == ["bad"] and "injected sampling fault" in failures["bad"]
    expected.pop("bad")
    # The others, seeded ones included (their numbers come from seed and position), are unchanged.
    assert tokens == expected
    assert used_blocks(engine) == 0
    engine.engine_core.scheduler.check_consistency()


def test_outputs_of_the_failing_step_are_not_lost(engine, monkeypatch):
    """"short" finishes in the very step in which "bad" fails: its output comes with the RequestFailedError."""
    fail_sampling_of(monkeypatch, engine, "bad", from_sample=2)
    engine.add_request("bad", PROMPTS["bad"], PARAMS["bad"])
    engine.add_request("short", PROMPTS["greedy"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    with pytest.raises(RequestFailedError) as failure:
        engine.step()
    assert list(failure.value.errors) == ["bad"]
    assert [o.request_id for o in failure.value.outputs] == ["short"] and failure.value.outputs[0].finished
    assert not engine.has_unfinished_requests() and used_blocks(engine) == 0


def test_prompt_logprobs_failure_fails_that_request_only(engine, monkeypatch):
    gather = isolated_outputs.gather_logprobs
    calls = []

    def faulty(logprobs, targets, num):
        calls.append(num)
        if num == [3] * len(num):  # the request that asked for 3 prompt logprobs
            raise RuntimeError("injected prompt-logprobs fault")
        return gather(logprobs, targets, num)

    monkeypatch.setattr(isolated_outputs, "gather_logprobs", faulty)
    engine.add_request("asks", "Hello there my friend", SamplingParams(max_tokens=3, prompt_logprobs=3))
    engine.add_request("fine", "Hello there my friend", SamplingParams(max_tokens=3, prompt_logprobs=1))
    tokens, failures = step_until_done(engine)
    assert list(failures) == ["asks"] and list(tokens) == ["fine"]
    assert len(tokens["fine"].prompt_logprobs) == len(tokens["fine"].prompt_token_ids)
    assert used_blocks(engine) == 0


def test_output_building_failure_fails_that_request_only(engine, monkeypatch):
    expected, _ = run(engine, ["greedy", "other"])
    processor = engine.output_processor
    update = processor._update_sequence

    def faulty(sequence, output, result):
        if output.group_id == "greedy" and len(sequence.token_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return update(sequence, output, result)

    monkeypatch.setattr(processor, "_update_sequence", faulty)
    tokens, failures = run(engine, ["greedy", "other"])
    assert list(failures) == ["greedy"] and tokens == {"other": expected["other"]}
    assert used_blocks(engine) == 0 and not processor.request_states


def test_a_failed_step_fails_only_the_requests_it_held(engine, monkeypatch):
    expected, _ = run(engine, ["greedy", "seeded"])
    seen = fail_nth_call(monkeypatch, runner(engine), "execute_model")
    # One request per step: the other waits through the failure.
    monkeypatch.setattr(engine.engine_core.scheduler.config, "max_num_seqs", 1)
    tokens, failures = run(engine, ["greedy", "seeded"])
    held = [s.request_id for s in seen[2].scheduled]
    assert list(failures) == held == ["greedy"] and "injected device error" in failures["greedy"]
    assert tokens == {"seeded": expected["seeded"]}
    assert used_blocks(engine) == 0
    engine.engine_core.scheduler.check_consistency()


def test_repeated_step_failures_stop_the_engine(tiny_model_factory, monkeypatch):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_factory("llama"), max_model_len=128,
                                                   kv_cache_memory_bytes=1 << 20))

    def broken(output):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(runner(engine), "execute_model", broken)
    failures = 0
    with pytest.raises(RuntimeError, match=f"{MAX_CONSECUTIVE_FAILED_STEPS} engine steps failed in a row"):
        for i in range(MAX_CONSECUTIVE_FAILED_STEPS):
            engine.add_request(f"r{i}", "Hello", SamplingParams(max_tokens=4))
            try:
                engine.step()
            except RequestFailedError:
                failures += 1
    assert failures == MAX_CONSECUTIVE_FAILED_STEPS - 1


def test_offline_generate_raises_and_the_llm_keeps_working(tiny_model_factory, monkeypatch):
    llm = LLM(model=str(tiny_model_factory("llama")), max_model_len=128, kv_cache_memory_bytes=1 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    before = llm.generate(list(PROMPTS.values()), greedy, use_tqdm=False)
    fail_sampling_of(monkeypatch, llm.llm_engine, str(len(PROMPTS) + 1))  # the next call's second prompt
    with pytest.raises(RequestFailedError, match="injected sampling fault"):
        llm.generate(list(PROMPTS.values()), greedy, use_tqdm=False)
    assert used_blocks(llm.llm_engine) == 0 and not llm.llm_engine.has_unfinished_requests()
    monkeypatch.undo()
    after = llm.generate(list(PROMPTS.values()), greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_async_streams_go_on_while_one_request_fails(engine, monkeypatch):
    expected, _ = run(engine, ["greedy", "seeded", "other"])
    fail_sampling_of(monkeypatch, engine, "bad")
    llm = AsyncLLM.from_engine(engine, log_stats=False)

    async def collect(name: str) -> list[list[int]]:
        tokens: dict[int, list[int]] = {}
        async for output in llm.generate(PROMPTS[name], PARAMS[name], name):
            for completion in output.outputs:
                tokens.setdefault(completion.index, []).extend(completion.token_ids)
        return [tokens[i] for i in sorted(tokens)]

    async def main():
        return await asyncio.gather(*(collect(name) for name in PARAMS), return_exceptions=True)

    try:
        results = dict(zip(PARAMS, asyncio.run(main())))
        assert llm.is_running
    finally:
        llm.shutdown()
    assert isinstance(results.pop("bad"), RequestFailedError)
    assert results == expected
    assert used_blocks(engine) == 0
