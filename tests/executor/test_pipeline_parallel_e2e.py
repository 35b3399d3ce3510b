"""Pipeline parallelism end to end: stages in worker processes (gloo), each holding a range of the decoder layers
and passing the residual stream on, give the single-rank engine's greedy tokens and logprobs, under chunked
prefill, preemption, n > 1, beam search and structured outputs with a batch per stage in flight
(--pipeline-overlap); with an uneven split and a tied LM head (Qwen3); combined with tensor parallelism (2 x 2
ranks); and on the default model (those two with the CPU default, one batch at a time)."""
from __future__ import annotations

import re

import pytest

from pagellm import LLM, SamplingParams
from pagellm.distributed.parallel_state import stage_layer_range
from pagellm.sampling_params import BeamSearchParams, StructuredOutputsParams

REGEX = r"[a-z]{2,5}-[0-9]{2}"


def greedy_with_logprobs(llm: LLM, prompts, max_tokens: int = 12) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same_greedy(got: list, want: list, tolerance: float = 1e-4) -> None:
    """Equal tokens, and logprobs of the same top tokens equal within `tolerance`."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, seq_got), (_, seq_want) in zip(got, want):
        for entry_got, entry_want in zip(seq_got, seq_want, strict=True):
            assert entry_got.keys() == entry_want.keys()
            for token, logprob in entry_got.items():
                assert logprob.logprob == pytest.approx(entry_want[token].logprob, abs=tolerance)


def generate_with(model_dir, prompts, run, **kwargs):
    """`run(llm, prompts)` on an engine built with `kwargs`, always shut down (its worker processes joined)."""
    llm = LLM(model=str(model_dir), **kwargs)
    try:
        return run(llm, prompts)
    finally:
        llm.shutdown()


def test_stage_layer_range_splits_evenly_earlier_stages_taking_the_remainder():
    assert [stage_layer_range(30, rank, 4) for rank in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layer_range(4, rank, 2) for rank in range(2)] == [(0, 2), (2, 4)]
    assert [stage_layer_range(3, rank, 3) for rank in range(3)] == [(0, 1), (1, 2), (2, 3)]


def test_two_stages_equal_one_on_a_tiny_model(tiny_model_factory, make_token_prompts, pool_bytes):
    """4 layers, 2 per stage, a batch per stage in flight. A 10-block pool (each stage caches half the layers, so
    half the bytes hold as many blocks) and a 32-token budget: chunked prefill and preemption happen in both runs."""
    model_dir = tiny_model_factory("llama", num_hidden_layers=4)
    prompts = make_token_prompts([7, 40, 70, 100], seed=21)

    def workload(llm: LLM, prompts) -> tuple:
        engine_core = llm.llm_engine.engine_core
        in_flight, constrained_in_flight, submit = [], [0], engine_core.executor.submit_model

        def counting_submit(output, bitmask=None):
            submit(output, bitmask)
            in_flight.append(len(engine_core._in_flight) + 1)
            if bitmask is not None:
                constrained_in_flight.append(in_flight[-1])

        engine_core.executor.submit_model = counting_submit
        greedy = greedy_with_logprobs(llm, prompts, max_tokens=16)
        sampled = llm.generate(prompts[:1], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6),
                               use_tqdm=False)
        beams = llm.beam_search(prompts[1:2], BeamSearchParams(beam_width=2, max_tokens=5))
        regex = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=REGEX))
        free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        constrained = llm.generate(prompts, [regex, free, regex, free], use_tqdm=False)
        return (greedy, [[c.token_ids for c in o.outputs] for o in sampled], [s.tokens for s in beams[0].sequences],
                engine_core.num_blocks, engine_core.scheduler.num_preemptions_total,
                engine_core.executor.collective_rpc("weight_bytes"), max(in_flight),
                [(o.outputs[0].text, o.outputs[0].token_ids) for o in constrained], max(constrained_in_flight))

    results = {pp: generate_with(model_dir, prompts, workload, max_model_len=128, max_num_batched_tokens=32,
                                 pipeline_parallel_size=pp, kv_cache_memory_bytes=pool_bytes(model_dir, 16, 10) // pp,
                                 pipeline_overlap=True)
               for pp in (1, 2)}
    assert_same_greedy(results[2][0], results[1][0])
    assert results[2][1:4] == results[1][1:4]  # the same pool: half the layers in half the bytes
    assert results[1][4] > 0 and results[2][4] > 0  # preempted (how often depends on how batches are split)
    # Each stage holds only its share of the weights (untied: embedding on the first, LM head on the last).
    stage_bytes, total_bytes = results[2][5], results[1][5][0]
    assert sum(stage_bytes) == total_bytes and max(stage_bytes) < total_bytes
    # Two batches were in flight at once (one per stage) with two stages, one at a time with one.
    assert (results[1][6], results[2][6]) == (1, 2)
    # Constrained batches too (each stage's bitmask follows its batch down the output rank's pipe), with the same
    # tokens and valid outputs.
    assert results[2][7] == results[1][7] and (results[1][8], results[2][8]) == (1, 2)
    assert all(re.fullmatch(REGEX, text) for text, _ in results[2][7][::2])


def test_uneven_stages_of_two_tensor_parallel_ranks_with_a_tied_lm_head(tiny_model_factory, make_token_prompts):
    """4 processes (pp_rank * 2 + tp_rank; the step result comes from rank 2) on Qwen3 (Q/K norms, the LM head tied
    to the embedding, which the last stage loads too) with 3 layers: stages of 2 + 1."""
    model_dir = tiny_model_factory("qwen3", num_hidden_layers=3)
    prompts = make_token_prompts([6, 21], seed=8)
    one = generate_with(model_dir, prompts, greedy_with_logprobs, max_model_len=64, kv_cache_memory_bytes=2 << 20)
    four = generate_with(model_dir, prompts, greedy_with_logprobs, max_model_len=64, kv_cache_memory_bytes=2 << 20,
                         tensor_parallel_size=2, pipeline_parallel_size=2)
    assert_same_greedy(four, one)


def test_two_stages_on_the_default_model():
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about paging."]
    results = {}
    for pp in (1, 2):
        llm = LLM(max_model_len=256, kv_cache_memory_bytes=32 << 20, pipeline_parallel_size=pp)
        try:
            results[pp] = greedy_with_logprobs(llm, prompts)
        finally:
            llm.shutdown()
    assert_same_greedy(results[2], results[1])
