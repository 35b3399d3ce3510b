"""The KV memory hierarchy end to end: prefix-cache hits, multi-turn reuse of generated tokens, swap preemption and
the host tier's second-level cache all leave greedy outputs equal to transformers', and logprobs equal to a run
with caching off."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("llama")
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def shared_prompts(make_token_prompts):
    """Six prompts: a 100-token shared prefix, then distinct tails of 3 to 40 tokens."""
    prefix = make_token_prompts([100], seed=11)[0]["prompt_token_ids"]
    tails = make_token_prompts([3, 9, 17, 25, 33, 40], seed=12)
    return [{"prompt_token_ids": prefix + t["prompt_token_ids"]} for t in tails]


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, **kwargs)


def greedy(max_tokens: int = NEW_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def test_shared_prefix_hits_and_matches_hf(tiny, shared_prompts, hf_greedy, no_leaks):
    model_dir, hf = tiny
    llm = make_llm(model_dir)
    first = llm.generate(shared_prompts[:1], greedy(), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate(shared_prompts[1:], greedy(), use_tqdm=False)
    for prompt, out in zip(shared_prompts, [first] + rest):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt["prompt_token_ids"], NEW_TOKENS)
    # Every later prompt finds the six full blocks of the shared 100-token prefix (96 tokens).
    assert [out.num_cached_tokens for out in rest] == [96] * len(rest)
    stats = llm.llm_engine.engine_core.scheduler.stats()
    assert stats.prefix_cache_hits == 96 * len(rest)
    assert stats.prefix_cache_queries == sum(len(p["prompt_token_ids"]) for p in shared_prompts)
    no_leaks(llm)


def test_logprobs_equal_with_caching_on_and_off(tiny, shared_prompts):
    model_dir, _ = tiny
    results = {}
    for caching in (True, False):
        llm = make_llm(model_dir, enable_prefix_caching=caching)
        llm.generate(shared_prompts[:1], greedy(), use_tqdm=False)
        results[caching] = llm.generate(shared_prompts[1:], greedy(logprobs=3), use_tqdm=False)
    assert all(out.num_cached_tokens == 96 for out in results[True])
    assert all(out.num_cached_tokens == 0 for out in results[False])
    for on, off in zip(results[True], results[False]):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        for entry_on, entry_off in zip(on.outputs[0].logprobs, off.outputs[0].logprobs):
            assert entry_on.keys() == entry_off.keys()
            for token, logprob in entry_on.items():
                assert logprob.logprob == pytest.approx(entry_off[token].logprob, abs=1e-4)


def test_full_hit_recomputes_only_the_last_block(tiny, make_token_prompts, hf_greedy):
    """A prompt of exactly four blocks seen before: the hit is capped below its last token, block-aligned."""
    model_dir, hf = tiny
    prompt = make_token_prompts([4 * BLOCK_SIZE], seed=13)[0]
    llm = make_llm(model_dir)
    outs = [llm.generate([prompt], greedy(), use_tqdm=False)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 3 * BLOCK_SIZE]
    expected = hf_greedy(hf, prompt["prompt_token_ids"], NEW_TOKENS)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == expected


def test_multi_turn_conversation_hits_its_earlier_answer(tiny, make_token_prompts, hf_greedy):
    """Turn 2 resends turn 1's prompt and answer: the hit covers generated tokens too."""
    model_dir, hf = tiny
    llm = make_llm(model_dir)
    turn1 = make_token_prompts([40], seed=14)[0]["prompt_token_ids"]
    answer = llm.generate([{"prompt_token_ids": turn1}], greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    turn2 = turn1 + answer + make_token_prompts([7], seed=15)[0]["prompt_token_ids"]
    out = llm.generate([{"prompt_token_ids": turn2}], greedy(), use_tqdm=False)[0]
    # 40 + 30 tokens were computed in turn 1 (the last answer token never was): four full blocks.
    assert out.num_cached_tokens == 4 * BLOCK_SIZE > len(turn1)
    assert out.outputs[0].token_ids == hf_greedy(hf, turn2, NEW_TOKENS)


def test_cache_salt_isolates_prefixes(tiny, shared_prompts):
    model_dir, _ = tiny
    llm = make_llm(model_dir)
    salted = [dict(p, cache_salt="tenant-a") for p in shared_prompts[:2]]
    outs = [llm.generate([p], greedy(), use_tqdm=False)[0] for p in salted]
    assert [o.num_cached_tokens for o in outs] == [0, 96]
    other = llm.generate([dict(shared_prompts[2], cache_salt="tenant-b")], greedy(), use_tqdm=False)[0]
    unsalted = llm.generate([shared_prompts[3]], greedy(), use_tqdm=False)[0]
    assert other.num_cached_tokens == unsalted.num_cached_tokens == 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_under_memory_pressure_matches_hf(tiny, make_token_prompts, hf_greedy, pool_bytes, no_leaks,
                                                     preemption_mode):
    """Eight requests that together need far more than the 20-block pool: they preempt each other, by recompute or
    by swapping to the host tier, and still produce transformers' tokens."""
    model_dir, hf = tiny
    prompts = make_token_prompts([60, 70, 80, 90, 100, 110, 120, 130], seed=16)
    llm = make_llm(model_dir, kv_cache_memory_bytes=pool_bytes(model_dir, BLOCK_SIZE, 20),
                   preemption_mode=preemption_mode, enable_prefix_caching=False, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, greedy(40), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt["prompt_token_ids"], 40)
    stats = llm.llm_engine.engine_core.scheduler.stats()
    assert stats.num_preemptions_total > 0
    if preemption_mode == "swap":
        assert stats.num_swapped_out_blocks_total > 0
        assert stats.num_swapped_in_blocks_total == stats.num_swapped_out_blocks_total
    else:
        assert stats.num_swapped_out_blocks_total == 0
    no_leaks(llm)


def test_host_tier_serves_prefixes_evicted_from_the_device(tiny, shared_prompts, make_token_prompts, hf_greedy,
                                                           pool_bytes, no_leaks):
    """A 24-block device pool: the shared prefix is evicted by unrelated prompts, copied to the host tier on the
    way out, and copied back for the next prompt that shares it (not recomputed)."""
    model_dir, hf = tiny
    llm = make_llm(model_dir, kv_cache_memory_bytes=pool_bytes(model_dir, BLOCK_SIZE, 24))
    llm.generate(shared_prompts[:1], greedy(), use_tqdm=False)
    for filler in make_token_prompts([200, 200], seed=17):
        llm.generate([filler], greedy(), use_tqdm=False)
    manager = llm.llm_engine.engine_core.kv_cache_manager
    swapped_in_before = manager.num_swapped_in_blocks
    out = llm.generate(shared_prompts[1:2], greedy(), use_tqdm=False)[0]
    assert out.num_cached_tokens == 96
    assert manager.num_swapped_in_blocks - swapped_in_before == 6  # all six prefix blocks came from the host
    assert out.outputs[0].token_ids == hf_greedy(hf, shared_prompts[1]["prompt_token_ids"], NEW_TOKENS)
    no_leaks(llm)


def test_parallel_sampling_and_beam_search_with_caching(tiny, shared_prompts):
    """n > 1 and beam search on a cached prefix give what they give without the cache."""
    model_dir, _ = tiny
    results = {}
    for caching in (True, False):
        llm = make_llm(model_dir, enable_prefix_caching=caching, seed=3)
        llm.generate(shared_prompts[:1], greedy(), use_tqdm=False)
        sampled = llm.generate(shared_prompts[1:2], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8),
                               use_tqdm=False)[0]
        from pagellm.sampling_params import BeamSearchParams
        beams = llm.beam_search(shared_prompts[2:3], BeamSearchParams(beam_width=3, max_tokens=6))[0]
        results[caching] = ([c.token_ids for c in sampled.outputs], [b.tokens for b in beams.sequences])
    assert results[True] == results[False]
