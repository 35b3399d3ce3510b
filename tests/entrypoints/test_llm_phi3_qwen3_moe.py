"""Phi-3 (partial rotary as in Phi-4-mini; LongRoPE as in Phi-3-mini-128k) and Qwen3-MoE (8 experts, top-2, one
dense layer) through the whole engine: tiny random-weight checkpoints written by transformers equal transformers'
float32 model token for token and logprob for logprob, through one-step and chunked prefill, prefix caching,
preemption and recomputation, n > 1, and two tensor-parallel ranks or pipeline stages.

The reference is teacher-forced: one uncached transformers forward over each sequence's own tokens, so every
position is checked whatever came before it. A greedy token may differ from transformers' only where its top two
logits are within 0.02 (a float near-tie). Prompts stay within the LongRoPE kind's original context (256), where
the short factors are transformers' choice too.
"""
from __future__ import annotations

import pytest
import torch
from teacher_forcing import assert_matches_transformers

from pagellm import LLM, SamplingParams
from pagellm.core.kv.kv_cache_groups import blocks_needed, group_size, kv_cache_groups
from pagellm.model_executor.layers.attention import layer_sliding_window

KINDS = ["phi3", "phi3-longrope", "qwen3_moe"]
PROMPT_LENS = [1, 6, 31, 90, 180]
NEW_TOKENS = 12
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module", params=KINDS)
def case(request, tiny_model_factory):
    """(model dir, transformers' float32 model of it), one per kind."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory(request.param)
    return model_dir, AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(make_token_prompts):
    return make_token_prompts(PROMPT_LENS, seed=290)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("overrides", [dict(), dict(max_num_batched_tokens=7, block_size=8)],
                         ids=["one-step-prefill", "chunked-7-block-8"])
def test_greedy_matches_transformers(overrides, case, prompts, no_leaks):
    model_dir, hf_model = case
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=8 << 20, **overrides)
    for output in llm.generate(prompts, greedy(), use_tqdm=False):
        assert len(output.outputs[0].token_ids) == NEW_TOKENS
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)


def test_cached_prefix_and_preemption(case, prompts, make_token_prompts, pool_bytes, no_leaks):
    """A second prompt reads a 96-token shared prefix from the cache; then a pool that holds one full-length
    request, not the batch, preempts and recomputes sequences."""
    model_dir, hf_model = case
    shared = make_token_prompts([100], seed=1)[0]["prompt_token_ids"]
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=8 << 20, block_size=8)
    outputs = [llm.generate({"prompt_token_ids": shared + tail["prompt_token_ids"]}, greedy(), use_tqdm=False)[0]
               for tail in make_token_prompts([7, 30], seed=2)]
    assert [o.num_cached_tokens for o in outputs] == [0, 96]
    for output in outputs:
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)
    del llm

    block_size = 8
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=block_size, max_num_batched_tokens=64,
              kv_cache_memory_bytes=one_request_pool(model_dir, block_size, pool_bytes))
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    for output in outputs:
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)


def one_request_pool(model_dir, block_size: int, pool_bytes) -> int:
    """Bytes of a pool that holds one full-length request (prefilled in 64-token chunks) and two blocks per KV
    cache group more, not the batch: with sliding-window layers in groups of their own, a page is a group's layers
    and those groups keep only their window's blocks."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    layers = config.num_hidden_layers
    groups = kv_cache_groups([layer_sliding_window(config, i) for i in range(layers)])
    chunk = 64  # the test's max_num_batched_tokens: a sliding group holds its window and one chunk
    pages = blocks_needed([g.window for g in groups], MAX_MODEL_LEN - chunk, chunk, block_size) + 2 * len(groups)
    return pool_bytes(model_dir, block_size, pages) * group_size(groups) // layers


def test_n_sampled_sequences_each_match(case, make_token_prompts, no_leaks):
    """n = 3 sequences sharing a 150-token prompt's blocks: each one's logprobs are those of its own tokens."""
    model_dir, hf_model = case
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=8 << 20, block_size=8)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, logprobs=0, ignore_eos=True)
    (output,) = llm.generate(make_token_prompts([150], seed=3), params, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    assert_matches_transformers(hf_model, output, greedy=False)
    no_leaks(llm)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_two_ranks(parallel, case, prompts):
    """Tensor parallel: each rank holds half of every head group and every expert's intermediate slice. Pipeline
    parallel: each stage builds (and makes sparse) only its own layers. Chunked prefill."""
    model_dir, hf_model = case
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=32, **parallel)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    llm.shutdown()
    for output in outputs:
        assert_matches_transformers(hf_model, output)
