"""Gemma 3 through the whole engine on a tiny random-weight model (tests/conftest.py's "gemma3": 7 layers, layer 5
global and the others local with a 16-token window, two RoPE bases, query_pre_attn_scalar 24): transformers'
float32 tokens and logprobs on prompts of up to 300 tokens, through chunked prefill, prefix caching of a prefix
longer than the window, preemption and recomputation, n > 1, the PyTorch attention backend, two tensor-parallel
ranks and two pipeline stages, and with final logit soft-capping.

The reference is teacher-forced: one uncached transformers forward over each sequence's own tokens, so every
position is checked whatever came before it. A greedy token may differ from transformers' only where its top two
logits are within 0.02 (a float near-tie).
"""
from __future__ import annotations

import math

import pytest
import torch
from teacher_forcing import assert_matches_transformers, check_teacher_forced, greedy_with_backend

from pagellm import LLM, SamplingParams
from pagellm.kernels.decoder import FusedDecoder

PROMPT_LENS = [5, 17, 100, 190, 300]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("gemma3")


@pytest.fixture(scope="module")
def prompts(make_token_prompts):
    return make_token_prompts(PROMPT_LENS, seed=29)


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("overrides", [dict(), dict(max_num_batched_tokens=7, block_size=8)],
                         ids=["one-step-prefill", "chunked-7-block-8"])
def test_greedy_matches_transformers(overrides, model_dir, prompts, hf_model, no_leaks):
    llm = LLM(model=str(model_dir), max_model_len=512, kv_cache_memory_bytes=8 << 20, **overrides)
    assert llm.llm_engine.config.model_config.max_model_len == 512
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    for output in outputs:
        assert len(output.outputs[0].token_ids) == NEW_TOKENS
        assert_matches_transformers(hf_model, output)
    model = llm.llm_engine.engine_core.executor.collective_rpc("__getattribute__", "model_runner")[0].model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert isinstance(model.fused_decoder(), FusedDecoder), "the decode steps ran the fused C step"
    no_leaks(llm)


def test_prefix_longer_than_the_window_from_the_cache(model_dir, make_token_prompts, hf_model, no_leaks):
    """The second prompt reuses 96 cached tokens of a 100-token shared prefix: its local layers read the cached
    tail of the prefix within the window, its global layer the whole prefix."""
    shared = make_token_prompts([100], seed=1)[0]["prompt_token_ids"]
    tails = make_token_prompts([7, 30], seed=2)
    llm = LLM(model=str(model_dir), max_model_len=512, kv_cache_memory_bytes=8 << 20, block_size=8)
    outputs = [llm.generate({"prompt_token_ids": shared + t["prompt_token_ids"]}, greedy(), use_tqdm=False)[0]
               for t in tails]
    assert (outputs[0].num_cached_tokens, outputs[1].num_cached_tokens) == (0, 96)
    for output in outputs:
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)


def test_preempted_and_recomputed_sequences_match(model_dir, prompts, hf_model, pool_bytes, no_leaks):
    """A pool that holds one full-length request, not the batch: sequences are preempted and recomputed. A block is
    one layer's page here (seven KV cache groups of one layer); one 320-token request holds 40 pages in the global
    layer's group and at most (16 + 64) / 8 + 2 in each local one: 100."""
    max_model_len, block_size = 320, 8
    llm = LLM(model=str(model_dir), max_model_len=max_model_len, block_size=block_size, max_num_batched_tokens=64,
              kv_cache_memory_bytes=pool_bytes(model_dir, block_size, 1) // 7 * 105)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
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


def test_final_logit_softcapping(tiny_model_factory, prompts):
    """A cap of 1.5 squashes the logits hard (their spread is several units here): tanh(logits / 1.5) * 1.5, as
    transformers applies it. Within +-1.5, no token's logprob exceeds 3 - log(vocab)."""

    from transformers import AutoModelForCausalLM

    capped_dir = tiny_model_factory("gemma3", final_logit_softcapping=1.5)
    hf_capped = AutoModelForCausalLM.from_pretrained(str(capped_dir), dtype=torch.float32).eval()
    assert hf_capped.config.final_logit_softcapping == 1.5
    llm = LLM(model=str(capped_dir), max_model_len=512, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=64)
    for output in llm.generate(prompts[:3], greedy(), use_tqdm=False):
        assert all(entry[t].logprob <= 3.0 - math.log(49152) for entry, t in zip(output.outputs[0].logprobs,
                                                                                   output.outputs[0].token_ids))
        assert_matches_transformers(hf_capped, output)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_two_ranks_match_transformers(parallel, model_dir, prompts, hf_model):
    """Two tensor-parallel ranks (2 query and 1 KV head each) or two pipeline stages (layers 0-3 and 4-6, the tied
    LM head on both), in worker processes."""
    llm = LLM(model=str(model_dir), max_model_len=512, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=48,
              **parallel)
    try:
        outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    for output in outputs:
        assert_matches_transformers(hf_model, output)


def test_torch_attention_backend_matches_transformers(model_dir, prompts, hf_model):
    """PAGELLM_ATTENTION_BACKEND=torch runs every prefill chunk and decode through the PyTorch reference backend's
    per-layer windows and query scale. The switch is read once per process, so the run is a separate one."""
    for prompt, tokens, logprobs in greedy_with_backend("torch", model_dir, prompts, NEW_TOKENS):
        check_teacher_forced(hf_model, prompt, tokens, logprobs)
