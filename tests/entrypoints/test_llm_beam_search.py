"""Beam search: `LLM.beam_search` against transformers' `num_beams` generate (no EOS: pure beam search) and
against a plain beam search written here over transformers' logits (EOS handling and the length penalty, with
the semantics BeamSearchParams documents). Beams share KV blocks; after every search the pool is free again."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, BeamSearchParams
from pagellm.beam_search import get_beam_search_score

MAX_MODEL_LEN = 96
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
               kv_cache_memory_bytes=8 << 20)


def hf_beam_search(hf_model, prompt: list[int], beam_width: int, max_tokens: int):
    """transformers' beam search with stopping disabled: (sequences incl. prompt, scores), best first."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    saved = hf_model.generation_config
    hf_model.generation_config = GenerationConfig()
    try:
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=beam_width,
                                    num_return_sequences=beam_width, max_new_tokens=max_tokens, eos_token_id=None,
                                    pad_token_id=0, length_penalty=1.0, output_scores=True,
                                    return_dict_in_generate=True)
    finally:
        hf_model.generation_config = saved
    return out.sequences.tolist(), out.sequences_scores.tolist()


def reference_beam_search(hf_model, prompt: list[int], params: BeamSearchParams, eos: frozenset[int]):
    """The documented algorithm, step by step, with one uncached transformers forward pass per beam."""
    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.inference_mode():
                logprobs = hf_model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(2 * params.beam_width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                if token in eos and not params.ignore_eos:
                    completed.append((tokens + [token], cum + value))
                else:
                    candidates.append((tokens + [token], cum + value))
        beams = sorted(candidates, key=lambda c: c[1], reverse=True)[:params.beam_width]
    completed += beams
    completed.sort(key=lambda c: get_beam_search_score(c[0], c[1], eos, params.length_penalty), reverse=True)
    return completed[:params.beam_width]


def test_matches_transformers_num_beams(llm, hf_model, make_token_prompts, no_leaks):
    prompts = make_token_prompts([3, 10, 17], seed=21)
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    outputs = llm.beam_search(prompts, params)
    for prompt, output in zip(prompts, outputs):
        sequences, scores = hf_beam_search(hf_model, prompt["prompt_token_ids"], 4, 8)
        assert [s.tokens for s in output.sequences] == sequences
        # transformers scores a beam as its summed logprob / generated length ** length_penalty.
        assert [s.cum_logprob / 8 for s in output.sequences] == pytest.approx(scores, abs=1e-4)
        assert all(s.finish_reason == "length" for s in output.sequences)
    no_leaks(llm)


def test_eos_and_length_penalty_match_reference(llm, hf_model, make_token_prompts, no_leaks, monkeypatch):
    prompt = make_token_prompts([7], seed=4)[0]["prompt_token_ids"]
    # Make a token the model often ranks among its top candidates the EOS, so beams really finish early.
    probe = reference_beam_search(hf_model, prompt, BeamSearchParams(2, 3, ignore_eos=True), frozenset())
    eos = frozenset({probe[0][0][len(prompt) + 1]})
    monkeypatch.setattr(llm.llm_engine.input_processor, "eos_token_ids", eos)
    for length_penalty in (1.0, 0.0, 2.0):
        params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=length_penalty)
        (output,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
        expected = reference_beam_search(hf_model, prompt, params, eos)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx([c for _, c in expected], abs=1e-3)
        assert any(s.finish_reason == "stop" for s in output.sequences)
        tokenizer = llm.get_tokenizer()
        for s in output.sequences:
            generated = s.tokens[len(prompt):-1] if s.finish_reason == "stop" else s.tokens[len(prompt):]
            assert s.text == tokenizer.decode(generated, skip_special_tokens=True)
    no_leaks(llm)


def peak_blocks(llm: LLM, prompt, params: BeamSearchParams) -> tuple[int, int]:
    """(most physical blocks in use, most blocks the beams' tables list) during one beam search."""
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    engine.add_beam_search_request("peak", prompt, params)
    physical = logical = 0
    while engine.has_unfinished_requests():
        engine.step()
        physical = max(physical, kv.block_pool.num_used_blocks)
        logical = max(logical, kv.num_logical_blocks)
    return physical, logical


def test_beams_share_blocks(llm, make_token_prompts, no_leaks):
    prompt = make_token_prompts([40], seed=2)[0]
    physical, logical = peak_blocks(llm, prompt, BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True))
    no_leaks(llm)
    # Seen between steps (the last step frees everything), four beams hold K/V for at most 40 + 8 tokens: 12
    # blocks each in their tables. Physically they share at least the 10 prompt blocks (and whatever generated
    # prefix they have in common).
    assert logical == 4 * 12
    assert physical <= logical - 3 * (40 // BLOCK_SIZE)


def test_beam_search_under_preemption(model_dir, hf_model, make_token_prompts, pool_bytes):
    """A pool just big enough for one group: beams of three prompts are preempted and recomputed."""
    prompts = make_token_prompts([5, 9, 14], seed=8)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    num_blocks = 3 * -(-(14 + 8) // BLOCK_SIZE) + 1
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN // 2, block_size=BLOCK_SIZE,
              kv_cache_memory_bytes=pool_bytes(model_dir, BLOCK_SIZE, max(num_blocks, MAX_MODEL_LEN // 8)))
    outputs = llm.beam_search(prompts, params)
    for prompt, output in zip(prompts, outputs):
        sequences, _ = hf_beam_search(hf_model, prompt["prompt_token_ids"], 3, 8)
        assert [s.tokens for s in output.sequences] == sequences
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    pool = llm.llm_engine.engine_core.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_invalid_beam_search_params(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.beam_search("hello", BeamSearchParams(beam_width=1000, max_tokens=4))
