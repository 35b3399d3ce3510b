"""Tensor parallelism end to end: ranks in worker processes (gloo), each holding a slice of every layer, give the
single-rank engine's greedy tokens and logprobs, under chunked prefill, preemption, n > 1 and beam search; and
on the default model with 3 ranks (its 9 query and 3 KV heads)."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import BeamSearchParams


def run_workload(llm: LLM, prompts) -> tuple:
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3),
                          use_tqdm=False)
    sampled = llm.generate(prompts[:1], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6), use_tqdm=False)
    beams = llm.beam_search(prompts[1:2], BeamSearchParams(beam_width=2, max_tokens=5))
    return ([o.outputs[0].token_ids for o in greedy], [o.outputs[0].logprobs for o in greedy],
            [[c.token_ids for c in o.outputs] for o in sampled], [s.tokens for s in beams[0].sequences],
            llm.llm_engine.engine_core.scheduler.num_preemptions_total)


def assert_same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0]
    for seq_got, seq_want in zip(got[1], want[1]):
        for entry_got, entry_want in zip(seq_got, seq_want):
            assert entry_got.keys() == entry_want.keys()
            for token, logprob in entry_got.items():
                assert logprob.logprob == pytest.approx(entry_want[token].logprob, abs=1e-4)
    assert got[2:] == want[2:]


def test_two_ranks_equal_one_on_a_tiny_model(tiny_model_factory, make_token_prompts, pool_bytes):
    """A 10-block pool and a 32-token budget: chunked prefill and preemption happen in both runs alike. (Every
    architecture's layers are compared rank by rank in tests/distributed.)"""
    model_dir = tiny_model_factory("llama")
    prompts = make_token_prompts([7, 40, 70, 100], seed=21)
    results = {}
    for tp in (1, 2):
        llm = LLM(model=str(model_dir), max_model_len=128, max_num_batched_tokens=32, tensor_parallel_size=tp,
                  kv_cache_memory_bytes=pool_bytes(model_dir, 16, 10) // tp)
        results[tp] = run_workload(llm, prompts)
        llm.shutdown()
    assert_same(results[2], results[1])
    assert results[2][4] > 0  # preempted


def test_three_ranks_on_the_default_model():
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about paging."]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = {}
    for tp in (1, 3):
        llm = LLM(max_model_len=256, kv_cache_memory_bytes=32 << 20, tensor_parallel_size=tp)
        results[tp] = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
    for one, three in zip(results[1], results[3]):
        assert three.outputs[0].token_ids == one.outputs[0].token_ids
        for entry_one, entry_three in zip(one.outputs[0].logprobs, three.outputs[0].logprobs):
            for token, logprob in entry_three.items():
                assert logprob.logprob == pytest.approx(entry_one[token].logprob, abs=1e-3)


def test_a_size_that_does_not_divide_the_heads_names_the_ones_that_do():
    with pytest.raises(ValueError, match="sizes that work: 1, 3, 9"):
        LLM(tensor_parallel_size=2)
