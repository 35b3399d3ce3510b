"""Mistral's sliding window through the whole engine, at its full context: a tiny random-weight Mistral whose layers
see only their last 16 tokens, on prompts of up to 300 tokens, equals transformers (float32, its own
sliding-window mask) token for token and logprob for logprob, through chunked prefill, prefix caching of a shared
prefix longer than the window, blocks out of the window freed (a pool smaller than the batch's tokens),
preemption and recomputation, n > 1, and the PyTorch attention backend.

The reference is teacher-forced: one uncached transformers forward over each sequence's own tokens, so every
position is checked whatever came before it. A greedy token may differ from transformers' only where its top two
logits are within 0.02 (a float near-tie).
"""
from __future__ import annotations

import pytest
from teacher_forcing import assert_matches_transformers, check_teacher_forced, greedy_with_backend

from pagellm import LLM, SamplingParams
from pagellm.kernels.decoder import FusedDecoder
from pagellm.spec_decode import adaptive

WINDOW = 16  # tests/conftest.py's "mistral" entry
PROMPT_LENS = [5, 17, 100, 190, 300]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("mistral")


@pytest.fixture(scope="module")
def prompts(make_token_prompts):
    return make_token_prompts(PROMPT_LENS, seed=29)


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)


def test_mistral_runs_at_its_full_context(model_dir):
    """No cap at the window: max_model_len defaults to max_position_embeddings."""
    llm = LLM(model=str(model_dir), kv_cache_memory_bytes=8 << 20)
    assert llm.llm_engine.config.model_config.max_model_len == 1024


@pytest.mark.parametrize("overrides", [dict(), dict(max_num_batched_tokens=40), dict(max_num_batched_tokens=7,
                                                                                      block_size=8)],
                         ids=["one-step-prefill", "chunked-40", "chunked-7-block-8"])
def test_greedy_matches_transformers(overrides, model_dir, prompts, hf_model, no_leaks):
    llm = LLM(model=str(model_dir), max_model_len=512, kv_cache_memory_bytes=8 << 20, **overrides)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    for output in outputs:
        assert len(output.outputs[0].token_ids) == NEW_TOKENS
        assert_matches_transformers(hf_model, output)
    model = llm.llm_engine.engine_core.executor.collective_rpc("__getattribute__", "model_runner")[0].model
    assert isinstance(model.fused_decoder(), FusedDecoder), "the decode steps ran the fused C step, with its windows"
    no_leaks(llm)


def test_prefix_longer_than_the_window_from_the_cache(model_dir, make_token_prompts, hf_model, no_leaks):
    """A second prompt reuses the first one's cached blocks of a 100-token shared prefix and still attends exactly
    within the window (its first chunk's queries read the cached tail of the prefix)."""
    shared = make_token_prompts([100], seed=1)[0]["prompt_token_ids"]
    tails = make_token_prompts([7, 30], seed=2)
    llm = LLM(model=str(model_dir), max_model_len=512, kv_cache_memory_bytes=8 << 20, block_size=8)
    outputs = [llm.generate({"prompt_token_ids": shared + t["prompt_token_ids"]}, greedy(), use_tqdm=False)[0]
               for t in tails]
    assert outputs[0].num_cached_tokens == 0
    assert outputs[1].num_cached_tokens == 96 > WINDOW
    for output in outputs:
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_blocks_out_of_the_window_are_freed(async_scheduling, model_dir, prompts, hf_model, pool_bytes, no_leaks):
    """A pool of 42 blocks (336 tokens) runs the 5 prompts' 672 tokens at once without preempting: each sequence
    keeps only the blocks its window still reads (with async scheduling too, a step planned while the one before
    it runs)."""
    block_size = 8
    llm = LLM(model=str(model_dir), max_model_len=320, block_size=block_size, max_num_batched_tokens=64,
              kv_cache_memory_bytes=pool_bytes(model_dir, block_size, 42), async_scheduling=async_scheduling)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    core = llm.llm_engine.engine_core
    assert sum(PROMPT_LENS) + len(PROMPT_LENS) * NEW_TOKENS > core.num_blocks * block_size
    assert core.scheduler.num_preemptions_total == 0
    assert core.kv_cache_manager.num_window_freed_blocks > 0
    for output in outputs:
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_sequences_match(preemption_mode, model_dir, make_token_prompts, hf_model, pool_bytes, no_leaks):
    """A pool of 11 blocks for 8 prompts of 40-60 tokens: even with freeing, sequences are preempted, and recomputed
    or swapped out and back in with their freed table entries."""
    block_size = 8
    llm = LLM(model=str(model_dir), max_model_len=80, block_size=block_size, max_num_batched_tokens=64,
              kv_cache_memory_bytes=pool_bytes(model_dir, block_size, 11), preemption_mode=preemption_mode,
              enable_prefix_caching=False)
    outputs = llm.generate(make_token_prompts([40, 45, 50, 60, 42, 47, 55, 58], seed=5), greedy(), use_tqdm=False)
    stats = llm.llm_engine.engine_core.scheduler.stats()
    assert stats.num_preemptions_total > 0, "the pool was meant to force preemption"
    if preemption_mode == "swap":
        assert stats.num_swapped_in_blocks_total == stats.num_swapped_out_blocks_total > 0
    for output in outputs:
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)


def test_n_sampled_sequences_each_match(model_dir, make_token_prompts, hf_model, no_leaks):
    """n = 4 sequences sharing a 150-token prompt's blocks: each one's logprobs are those of its own tokens."""
    llm = LLM(model=str(model_dir), max_model_len=512, kv_cache_memory_bytes=8 << 20, block_size=8)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=24, logprobs=0, ignore_eos=True)
    (output,) = llm.generate(make_token_prompts([150], seed=3), params, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4
    assert_matches_transformers(hf_model, output, greedy=False)
    no_leaks(llm)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forced_attention_backend_matches_transformers(backend, model_dir, prompts, hf_model):
    """PAGELLM_ATTENTION_BACKEND=torch (or triton, under Triton's interpreter here) runs every decode and prefill
    chunk through that backend's windowed attention (no fused C step): the same tokens and logprobs. The switch is
    read once per process, so the run is a separate one."""
    for prompt, tokens, logprobs in greedy_with_backend(backend, model_dir, prompts, NEW_TOKENS):
        check_teacher_forced(hf_model, prompt, tokens, logprobs)


def test_speculative_decoding_with_freed_blocks(model_dir, make_token_prompts, hf_model, pool_bytes, no_leaks,
                                               monkeypatch):
    """Ngram drafts over repetitive 120-token prompts (look-ahead slots past the window's blocks) in a 42-block
    pool that frees blocks out of the window: every accepted token is transformers' greedy one. Every match drafts
    k tokens (the adaptive length switched off): the random model's output seldom repeats, and this is about the
    blocks, not about when drafts pay."""
    monkeypatch.setattr(adaptive, "best_length", lambda rate, max_k, *_: max_k)
    block_size = 8
    base = [t["prompt_token_ids"] for t in make_token_prompts([12, 15, 20], seed=9)]
    prompts = [{"prompt_token_ids": (ids * 10)[:120]} for ids in base]
    llm = LLM(model=str(model_dir), max_model_len=320, block_size=block_size, max_num_batched_tokens=64,
              kv_cache_memory_bytes=pool_bytes(model_dir, block_size, 42),
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    outputs = llm.generate(prompts, greedy(24), use_tqdm=False)
    core = llm.llm_engine.engine_core
    assert core.kv_cache_manager.num_window_freed_blocks > 0
    assert core.scheduler.stats().spec_decode_num_accepted_tokens > 0, "drafts were accepted"
    for output in outputs:
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)
