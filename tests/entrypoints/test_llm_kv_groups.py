"""Gemma 3's KV cache groups through the whole engine: a tiny random-weight Gemma 3 of 8 layers (two global, six
local with a 24-token window) runs as one full-attention group and three sliding groups of two layers each, whose
block tables free what leaves the window. Long generations in a pool too small for every layer to keep every token
give transformers' float32 tokens and logprobs (teacher-forced), through prefix caching, preemption by recompute and
by swap, n > 1, and the one-call CPU decode step; the accounting of every group is checked after each run.
"""
from __future__ import annotations

import pytest
from teacher_forcing import assert_matches_transformers

from pagellm import LLM, SamplingParams
from pagellm.kernels.decoder import FusedDecoder

WINDOW = 24
LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
LAYERS_PER_PAGE = 2  # the smallest type's layers (2 global) per group: a block is two layers' page


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("gemma3", num_hidden_layers=8, layer_types=LAYER_TYPES, sliding_window=WINDOW)


def page_bytes(pool_bytes, model_dir, block_size: int) -> int:
    """One block: K and V of two layers (kv_pool_bytes counts all eight)."""
    return pool_bytes(model_dir, block_size, 1) // len(LAYER_TYPES) * LAYERS_PER_PAGE


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)


def every_token_every_layer(num_tokens: int, block_size: int) -> int:
    """Pages the sequence would hold if each layer kept every token: four groups of its whole length."""
    return 4 * -(-num_tokens // block_size)


def test_groups_and_tables():
    from pagellm.core.kv.kv_cache_groups import kv_cache_groups

    windows = [WINDOW if t == "sliding_attention" else None for t in LAYER_TYPES]
    groups = kv_cache_groups(windows)
    assert [(g.window, g.layers) for g in groups] == [(None, (3, 7)), (WINDOW, (0, 1)), (WINDOW, (2, 4)),
                                                        (WINDOW, (5, 6))]


@pytest.mark.parametrize("block_size", [4, 16])
def test_long_generation_in_a_pool_too_small_for_full_attention(block_size, model_dir, make_token_prompts, hf_model,
                                                                 pool_bytes, no_leaks):
    """Two 40-token prompts generate 260 tokens each (300 tokens a sequence) in a pool of 210 pages at block size 4
    (60 at 16): with every token in every layer one sequence alone would need 4 * 300 / block_size pages (300; 76).
    The sliding groups keep only their window's blocks, so both run at once and match transformers everywhere."""
    new_tokens = 260
    num_blocks = 210 if block_size == 4 else 60
    llm = LLM(model=str(model_dir), max_model_len=320, block_size=block_size, max_num_batched_tokens=32,
              kv_cache_memory_bytes=page_bytes(pool_bytes, model_dir, block_size) * num_blocks)
    core = llm.llm_engine.engine_core
    assert core.num_blocks == num_blocks
    assert len(core.kv_cache_manager.groups) == core.scheduler.stats().num_kv_cache_groups == 4
    assert every_token_every_layer(40 + new_tokens, block_size) > num_blocks, "one sequence would not fit"
    outputs = llm.generate(make_token_prompts([40, 40], seed=11), greedy(new_tokens), use_tqdm=False)
    assert core.scheduler.num_preemptions_total == 0
    assert core.kv_cache_manager.num_window_freed_blocks > 0
    for output in outputs:
        assert len(output.outputs[0].token_ids) == new_tokens
        assert_matches_transformers(hf_model, output)
    model = core.executor.collective_rpc("__getattribute__", "model_runner")[0].model
    assert isinstance(model.fused_decoder(), FusedDecoder), "the decode steps ran the fused C step, per group"
    no_leaks(llm)


def test_prefix_hit_takes_every_group(model_dir, make_token_prompts, hf_model, no_leaks):
    """A 100-token shared prefix: the second prompt finds 96 tokens cached, the global group's whole prefix and the
    local groups' blocks inside the window, and still matches transformers."""
    shared = make_token_prompts([100], seed=1)[0]["prompt_token_ids"]
    tails = make_token_prompts([9, 30], seed=2)
    llm = LLM(model=str(model_dir), max_model_len=256, kv_cache_memory_bytes=8 << 20, block_size=8)
    outputs = [llm.generate({"prompt_token_ids": shared + t["prompt_token_ids"]}, greedy(40), use_tqdm=False)[0]
               for t in tails]
    assert (outputs[0].num_cached_tokens, outputs[1].num_cached_tokens) == (0, 96)
    for output in outputs:
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_restores_every_group(preemption_mode, model_dir, make_token_prompts, hf_model, pool_bytes,
                                         no_leaks):
    """Six sequences of up to 155 tokens in 70 pages of 8 tokens: even with the windows freed they do not all fit,
    so sequences are preempted and recomputed, or swapped out and back in with every group's table (prefix caching
    off: every block copied out is a swapped request's, and comes back)."""
    block_size = 8
    llm = LLM(model=str(model_dir), max_model_len=160, block_size=block_size, max_num_batched_tokens=64,
              kv_cache_memory_bytes=page_bytes(pool_bytes, model_dir, block_size) * 70,
              preemption_mode=preemption_mode, enable_prefix_caching=False)
    outputs = llm.generate(make_token_prompts([30, 35, 40, 45, 50, 55], seed=5), greedy(100), use_tqdm=False)
    stats = llm.llm_engine.engine_core.scheduler.stats()
    assert stats.num_preemptions_total > 0, "the pool was meant to force preemption"
    if preemption_mode == "swap":
        assert stats.num_swapped_in_blocks_total == stats.num_swapped_out_blocks_total > 0
    for output in outputs:
        assert_matches_transformers(hf_model, output)
    no_leaks(llm)


def test_n_sequences_share_every_group(model_dir, make_token_prompts, hf_model, no_leaks):
    """n = 3 samples of a 60-token prompt fork every group's table (copy-on-write of the shared partial blocks):
    each sequence's logprobs are those of its own tokens."""
    llm = LLM(model=str(model_dir), max_model_len=256, kv_cache_memory_bytes=8 << 20, block_size=8)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=80, logprobs=0, ignore_eos=True)
    (output,) = llm.generate(make_token_prompts([60], seed=4), params, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    assert_matches_transformers(hf_model, output, greedy=False)
    no_leaks(llm)


def test_the_kv_budget_needs_the_window_not_every_token_in_every_group(model_dir, pool_bytes):
    """One 320-token request in 32-token chunks holds, at block size 4, 80 blocks in the global group and, in each
    local group, the blocks from its last chunk's first query's window on (keys from 288 - 24 + 1 = 265: block 66)
    to its end: 14. A pool of 80 + 3 * 14 = 122 pages starts; one page fewer is refused, naming what it needs."""
    page = page_bytes(pool_bytes, model_dir, 4)
    needed = 80 + 3 * (80 - (288 - WINDOW + 1) // 4)
    assert needed == 122
    llm = LLM(model=str(model_dir), max_model_len=320, block_size=4, max_num_batched_tokens=32,
              kv_cache_memory_bytes=page * needed)
    assert llm.llm_engine.engine_core.num_blocks == needed
    llm.shutdown()
    with pytest.raises(ValueError, match=f"needs {needed} blocks"):
        LLM(model=str(model_dir), max_model_len=320, block_size=4, max_num_batched_tokens=32,
            kv_cache_memory_bytes=page * (needed - 1))


def test_n_is_checked_against_every_groups_blocks(model_dir, make_token_prompts, pool_bytes, no_leaks):
    """n sequences of a 200-token prompt at their first token, block size 16: the global group holds the prompt's
    12 full blocks shared and one block per sequence; each of the three local groups one shared block (inside the
    window) and one per sequence: 15 + 4n pages. A 60-page pool takes n = 11 (59) and refuses n = 12 (63), which a
    count of one table (12 + n) would have let through to a pool that can never hold it."""
    from pagellm.exceptions import InvalidRequestError

    llm = LLM(model=str(model_dir), max_model_len=320, block_size=16, max_num_batched_tokens=32,
              kv_cache_memory_bytes=page_bytes(pool_bytes, model_dir, 16) * 60)
    prompt = make_token_prompts([200], seed=12)
    with pytest.raises(InvalidRequestError, match="n is too large for the KV cache: 12 sequences .* need 63 KV"):
        llm.generate(prompt, SamplingParams(n=12, max_tokens=2), use_tqdm=False)
    (output,) = llm.generate(prompt, SamplingParams(n=11, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [len(c.token_ids) for c in output.outputs] == [2] * 11
    no_leaks(llm)
