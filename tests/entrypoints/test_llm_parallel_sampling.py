"""n > 1: one prompt, n sampled sequences sharing the prompt's KV blocks (copy-on-write of the last one).

A bug in sharing or copy-on-write makes a sequence attend to another sequence's K/V, which changes its logits.
So each sampled token's logprob (logprobs=0 returns it, from the raw logits) is checked against transformers
run on exactly that sequence's tokens (teacher forcing, no cache): an independent reference for every
sequence, whatever was sampled.
"""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams

MAX_MODEL_LEN = 96
BLOCK_SIZE = 4



@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
               kv_cache_memory_bytes=8 << 20)


def hf_token_logprobs(hf_model, prompt: list[int], generated: list[int]) -> list[float]:
    """log p(generated[i] | prompt + generated[:i]) from one uncached transformers forward pass."""
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logprobs = hf_model(ids).logits[0].float().log_softmax(-1)
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(generated))
    return [logprobs[p, t].item() for p, t in zip(positions, generated)]


def assert_sequences_match_hf(hf_model, output, n: int) -> None:
    prompt = output.prompt_token_ids
    assert [c.index for c in output.outputs] == list(range(n))
    for completion in output.outputs:
        ours = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
        expected = hf_token_logprobs(hf_model, prompt, completion.token_ids)
        assert ours == pytest.approx(expected, abs=1e-3), f"sequence {completion.index} diverged from its own tokens"


# Prompt lengths ending mid-block (copy-on-write of the shared last block) and on a block boundary (none needed).
@pytest.mark.parametrize("prompt_len", [1, 6, 8, 13])
def test_n_sequences_each_match_transformers(llm, hf_model, make_token_prompts, no_leaks, prompt_len):
    prompt = make_token_prompts([prompt_len], seed=prompt_len)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, logprobs=0, ignore_eos=True)
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    assert output.finished and len(output.outputs) == 4
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4  # sampled: the sequences differ
    assert all(c.finish_reason == "length" and len(c.token_ids) == 10 for c in output.outputs)
    assert_sequences_match_hf(hf_model, output, 4)
    no_leaks(llm)


def test_n_greedy_sequences_are_identical(llm, hf_greedy, hf_model, make_token_prompts, no_leaks):
    prompt = make_token_prompts([9], seed=5)[0]
    (output,) = llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)
    expected = hf_greedy(hf_model, prompt["prompt_token_ids"], 8)
    assert [c.token_ids for c in output.outputs] == [expected] * 3
    assert len({c.text for c in output.outputs}) == 1
    no_leaks(llm)


def peak_blocks(llm: LLM, prompts, params) -> int:
    """The most KV blocks in use at once while the requests run."""
    engine = llm.llm_engine
    pool = engine.engine_core.kv_cache_manager.block_pool
    for i, prompt in enumerate(prompts):
        engine.add_request(f"peak-{i}", prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, pool.num_used_blocks)
    return peak


def test_n_uses_fewer_blocks_than_separate_requests(model_dir, make_token_prompts, no_leaks):
    # Without the prefix cache, which would also share the separate requests' prompt blocks.
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, kv_cache_memory_bytes=8 << 20,
              enable_prefix_caching=False)
    prompt = make_token_prompts([40], seed=1)[0]  # exactly 10 full blocks, shared by all 4 sequences
    sampled = dict(temperature=1.0, seed=2, max_tokens=12, ignore_eos=True)
    shared = peak_blocks(llm, [prompt], SamplingParams(n=4, **sampled))
    separate = peak_blocks(llm, [prompt] * 4, SamplingParams(**sampled))
    no_leaks(llm)
    prompt_blocks = 40 // BLOCK_SIZE
    # Separate requests hold 4 copies of the prompt's blocks; shared, one.
    assert separate == 4 * (separate // 4)
    assert shared == separate - 3 * prompt_blocks


def test_seeded_n_is_reproducible_across_batches_and_preemption(model_dir, make_token_prompts, no_leaks,
                                                                pool_bytes):
    prompts = make_token_prompts([5, 30, 47, 12], seed=9)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    alone = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                kv_cache_memory_bytes=8 << 20)
    expected = [[c.token_ids for c in alone.generate(p, params, use_tqdm=False)[0].outputs] for p in prompts]
    # A pool of just over one max_model_len request: the batch cannot fit, and not even the longest prompt's n
    # sequences at full length, so sequences are preempted (and still finish with the same tokens).
    num_blocks = MAX_MODEL_LEN // BLOCK_SIZE + 2
    small = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                kv_cache_memory_bytes=pool_bytes(model_dir, BLOCK_SIZE, num_blocks))
    mixed = small.generate(prompts + prompts[:2], [params] * 4 + [other] * 2, use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert [[c.token_ids for c in o.outputs] for o in mixed[:4]] == expected
    no_leaks(small)


def test_abort_frees_every_sequence(llm, make_token_prompts, no_leaks):
    engine = llm.llm_engine
    engine.add_request("abort-me", make_token_prompts([21], seed=3)[0],
                       SamplingParams(n=4, temperature=1.0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.engine_core.scheduler.running) == 4
    engine.abort_request(["abort-me"])
    assert not engine.has_unfinished_requests()
    no_leaks(llm)


def test_invalid_n_names_the_field():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"n must be an integer in \[1, "):
            SamplingParams(n=bad)
