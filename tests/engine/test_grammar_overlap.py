"""The grammar bitmask of a step is computed while the step's forward pass runs (the in-process executor: on the
structured-output manager's thread while the engine thread runs the model), and the rank that samples waits for it
only then. Timed with a grammar whose mask takes SLEEP_S and a forward pass made to take as long: a constrained
step takes about SLEEP_S, not twice that, and the two spans overlap. A bitmask that cannot be computed fails the
step's constrained request alone."""
from __future__ import annotations

import re
import time

import pytest
from engine_steps import step_until_done

from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.structured_output.backend_guidance import GuidanceGrammar

SLEEP_S = 0.25
REGEX = "[ab]{3}"
CONSTRAINED = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(regex=REGEX))
FREE = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(one_thread_engine) -> LLMEngine:
    return one_thread_engine


def run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> tuple[dict[str, list[int]], dict[str, str], str]:
    """Step until done; returns (token ids per request, failures, the constrained request's text)."""
    for request_id, params in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": [100, 200, 300, 400]}, params)
    outputs, failures = step_until_done(engine)
    tokens = {request_id: output.outputs[0].token_ids for request_id, output in outputs.items()}
    return tokens, failures, outputs["c"].outputs[0].text if "c" in outputs else ""


def test_the_bitmask_is_computed_during_the_forward_pass(engine, monkeypatch):
    spans: dict[str, list[tuple[float, float]]] = {"mask": [], "forward": []}

    def slowed(kind: str, function):
        def run_slowly(*args, **kwargs):
            start = time.perf_counter()
            time.sleep(SLEEP_S)
            result = function(*args, **kwargs)
            spans[kind].append((start, time.perf_counter()))
            return result
        return run_slowly

    monkeypatch.setattr(GuidanceGrammar, "fill_bitmask", slowed("mask", GuidanceGrammar.fill_bitmask))
    model = engine.engine_core.executor.worker.model_runner.model
    monkeypatch.setattr(model, "forward", slowed("forward", model.forward))
    step = engine.step

    def timed_step():
        start = time.perf_counter()
        result = step()
        if spans["forward"] and spans["forward"][-1][0] >= start:  # this step ran the model
            step_seconds.append(time.perf_counter() - start)
        return result

    step_seconds: list[float] = []
    monkeypatch.setattr(engine, "step", timed_step)
    tokens, failures, text = run(engine, {"c": CONSTRAINED})
    assert not failures and re.fullmatch(REGEX, text)
    # One mask per step (one constrained sequence), each overlapping that step's forward pass by most of SLEEP_S.
    assert len(spans["mask"]) == len(spans["forward"]) == len(tokens["c"]) == len(step_seconds) >= 2
    for (mask_start, mask_end), (forward_start, forward_end) in zip(spans["mask"], spans["forward"]):
        assert min(mask_end, forward_end) - max(mask_start, forward_start) > 0.6 * SLEEP_S
    # Sequential, a step would take at least 2 * SLEEP_S.
    assert max(step_seconds) < 1.6 * SLEEP_S, step_seconds


def test_a_bitmask_that_fails_fails_its_requests_alone(engine, monkeypatch):
    expected, failures, _ = run(engine, {"f": FREE})
    assert not failures

    def broken(self, bitmask, row):
        raise RuntimeError("injected mask failure")

    monkeypatch.setattr(GuidanceGrammar, "fill_bitmask", broken)
    tokens, failures, _ = run(engine, {"c": CONSTRAINED, "f": FREE})
    assert list(failures) == ["c"] and "injected mask failure" in failures["c"]
    assert tokens == expected
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0
    engine.engine_core.scheduler.check_consistency()
