"""`--async-scheduling` end to end on a tiny random Llama: batch N+1 is scheduled and submitted before batch N's
results are applied, decodes continuing blind from the token N samples. Greedy tokens equal transformers'; every
sampling feature (seeded sampling with logprobs, penalties, n > 1, min_tokens, stop tokens and strings, grammars,
beam search) gives exactly what the synchronous engine gives; nothing leaks."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import BeamSearchParams, StructuredOutputsParams

PROMPT_LENS = [3, 9, 17, 30, 45, 64, 5, 100]
MAX_NEW = [20, 1, 2, 24, 7, 16, 24, 12]


def make_llm(model_dir, async_scheduling: bool) -> LLM:
    # A small token budget chunks the longer prompts, so prompt chunks also follow each other in flight.
    return LLM(model=str(model_dir), max_model_len=256, kv_cache_memory_bytes=8 << 20, block_size=8,
               max_num_batched_tokens=48, async_scheduling=async_scheduling)


@pytest.fixture(scope="module")
def sync_llm(model_dir) -> LLM:
    return make_llm(model_dir, False)


@pytest.fixture(scope="module")
def async_llm(model_dir) -> LLM:
    llm = make_llm(model_dir, True)
    core = llm.llm_engine.engine_core
    submit, submit_forward = core.executor.submit_model, core.executor.submit_forward
    llm.depths, llm.blind, llm.blind_constrained = [], [], []

    def record(output):
        llm.depths.append(len(core._in_flight) + 1)
        llm.blind.append(sum(s.pending_token for s in output.scheduled))
        llm.blind_constrained.append(sum(s.pending_token for s in output.scheduled
                                         if s.request_id in output.structured_output_request_ids))

    def counting_submit(output, bitmask=None):
        record(output)
        return submit(output, bitmask)

    def counting_submit_forward(output):
        record(output)
        return submit_forward(output)

    core.executor.submit_model, core.executor.submit_forward = counting_submit, counting_submit_forward
    return llm


def test_greedy_matches_transformers_with_two_batches_in_flight(async_llm, hf_model, hf_greedy, make_token_prompts,
                                                               no_leaks):
    prompts = make_token_prompts(PROMPT_LENS, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
    async_llm.depths.clear(), async_llm.blind.clear()
    outputs = async_llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, n in zip(prompts, outputs, MAX_NEW):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt["prompt_token_ids"], n)
        assert out.outputs[0].finish_reason == "length"
    # The steps really overlapped: a batch was submitted with another in flight, its decodes continuing blind.
    assert max(async_llm.depths) == 2 and sum(async_llm.blind) > sum(MAX_NEW) // 2
    no_leaks(async_llm)


def mixed_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3, max_tokens=14, ignore_eos=True, stop=["e"]),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2, logprobs=1),
    ]


def summary(outputs) -> tuple[list, list[float]]:
    """(everything exact: tokens, text, finish and stop reasons, logprob token ids and ranks; every logprob value,
    which batch composition may move by float noise)."""
    exact, values = [], []
    for out in outputs:
        for c in out.outputs:
            entries = [*(c.logprobs or []), *(out.prompt_logprobs or [])]
            exact.append((c.token_ids, c.text, c.finish_reason, c.stop_reason,
                          [{t: lp.rank for t, lp in entry.items()} for entry in entries if entry]))
            values += [lp.logprob for entry in entries if entry for lp in entry.values()]
            values += [c.cumulative_logprob] if c.logprobs else []
    return exact, values


def test_every_sampling_feature_gives_what_the_synchronous_engine_gives(sync_llm, async_llm, make_token_prompts,
                                                                      no_leaks):
    prompts = make_token_prompts([12, 20, 7, 15, 33, 10, 6, 18], seed=5)
    # A stop token the greedy continuation of the fifth prompt reaches after a few tokens: that request ends
    # while its next token is already in flight.
    greedy = sync_llm.generate(prompts[4], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    params = mixed_params(greedy[3])
    expected, expected_values = summary(sync_llm.generate(prompts, params, use_tqdm=False))
    got, values = summary(async_llm.generate(prompts, params, use_tqdm=False))
    assert got == expected
    assert values == pytest.approx(expected_values, abs=1e-4)
    stopped = got[6]  # the fifth request (after the third request's n=3 sequences)
    assert stopped[2] == "stop" and len(stopped[0]) <= 4
    no_leaks(async_llm)
    no_leaks(sync_llm)


def test_grammars_continue_blind_and_outputs_stay_in_their_grammar(sync_llm, async_llm, make_token_prompts,
                                                                   no_leaks):
    """A constrained decode's next step runs blind too: its sampling waits for the bitmask of the grammar advanced
    by the token in flight. Outputs match their grammars and the synchronous engine's."""
    import json
    import re

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(
                  regex="[a-z]{3,8}( [a-z]{3,8}){2,4}")),
              SamplingParams(temperature=0.9, seed=4, max_tokens=60, structured_outputs=StructuredOutputsParams(
                  json=schema, disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    prompts = make_token_prompts([9, 13, 6], seed=31)
    expected = [o.outputs[0] for o in sync_llm.generate(prompts, params, use_tqdm=False)]
    async_llm.blind_constrained.clear()
    got = [o.outputs[0] for o in async_llm.generate(prompts, params, use_tqdm=False)]
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in expected]
    assert re.fullmatch("[a-z]{3,8}( [a-z]{3,8}){2,4}", got[0].text)
    if got[1].finish_reason == "stop":
        assert set(json.loads(got[1].text)) == {"name", "age"}
    assert sum(async_llm.blind_constrained) >= 5
    no_leaks(async_llm)


def test_beam_search_gives_what_the_synchronous_engine_gives(sync_llm, async_llm, make_token_prompts, no_leaks):
    prompts = make_token_prompts([8, 14], seed=9)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    expected = [[(s.tokens, s.cum_logprob) for s in out.sequences] for out in sync_llm.beam_search(prompts, params)]
    got = [[(s.tokens, s.cum_logprob) for s in out.sequences] for out in async_llm.beam_search(prompts, params)]
    assert got == expected
    no_leaks(async_llm)


def test_min_tokens_and_penalties_count_the_token_in_flight(sync_llm, async_llm, make_token_prompts):
    """A blind step's sampler counts the token still in flight: min_tokens lifts the ban on a stop token exactly
    when the k-th output token is due (the stop token being the k-th greedy token, the output is the first k + 1
    greedy tokens), and strong penalties see the token just sampled, as in the synchronous engine."""
    prompt = make_token_prompts([11], seed=21)[0]
    greedy = sync_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    k = next(k for k in range(3, 10) if greedy[k] not in greedy[:k])
    stop_at_k = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, min_tokens=k,
                               stop_token_ids=[greedy[k]])
    for llm in (sync_llm, async_llm):
        out = llm.generate(prompt, stop_at_k, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == greedy[:k + 1] and out.finish_reason == "stop"
    penalized = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                               presence_penalty=2.0, repetition_penalty=2.0)
    prompts = make_token_prompts([5, 9, 14], seed=22)
    expected = [o.outputs[0].token_ids for o in sync_llm.generate(prompts, penalized, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in async_llm.generate(prompts, penalized, use_tqdm=False)] == expected
