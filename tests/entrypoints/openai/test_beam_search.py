"""Beam search served on /v1/completions (vLLM's `use_beam_search`, `n` beams) through the official openai SDK: the
choices are the beams the offline `LLM.beam_search` finds for the same prompt, best first, streamed or not; fields
beam search cannot honour are refused with a 400 naming them."""
from __future__ import annotations

import openai
import pytest
import torch

from pagellm import LLM, BeamSearchParams
from tests.conftest import SERVER_MAX_MODEL_LEN

MODEL_NAME = "tiny"  # as served by the `server` fixture
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
BEAM_WIDTH = 3
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def offline(model_dir):
    """What LLM.beam_search finds for each prompt: [(generated token ids, text, finish reason)] per beam."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs (OMP_NUM_THREADS=1)
    try:
        with LLM(model=str(model_dir), max_model_len=SERVER_MAX_MODEL_LEN, kv_cache_memory_bytes=4 << 20) as llm:
            tokenizer = llm.get_tokenizer()
            results = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS))
    finally:
        torch.set_num_threads(previous)
    expected = []
    for prompt, result in zip(PROMPTS, results):
        num_prompt_tokens = len(tokenizer.encode(prompt))
        expected.append([(s.tokens[num_prompt_tokens:], s.text, s.finish_reason) for s in result.sequences])
    return expected


def beam_search(client, prompt, **kwargs):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, n=BEAM_WIDTH, max_tokens=MAX_TOKENS,
                                     extra_body={"use_beam_search": True}, **kwargs)


def test_beams_match_offline_beam_search(client, tokenizer, offline):
    response = beam_search(client, PROMPTS)
    assert [c.index for c in response.choices] == list(range(len(PROMPTS) * BEAM_WIDTH))
    for i, beams in enumerate(offline):
        choices = response.choices[i * BEAM_WIDTH:(i + 1) * BEAM_WIDTH]
        assert [(c.text, c.finish_reason) for c in choices] == [(text, reason) for _, text, reason in beams]
    generated = sum(len(ids) for beams in offline for ids, _, _ in beams)
    assert response.usage.completion_tokens == generated
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)


def test_streamed_beams_arrive_whole(client, offline):
    chunks = list(beam_search(client, PROMPTS[0], stream=True, stream_options={"include_usage": True}))
    choices = sorted((c for chunk in chunks for c in chunk.choices), key=lambda c: c.index)
    assert [(c.text, c.finish_reason) for c in choices] == [(text, reason) for _, text, reason in offline[0]]
    assert chunks[-1].usage.completion_tokens == sum(len(ids) for ids, _, _ in offline[0])


@pytest.mark.parametrize("extra", [{"temperature": 0.8}, {"stop": ["\n"]}, {"logprobs": 2}, {"seed": 1}])
def test_fields_beam_search_cannot_honour_are_refused(client, extra):
    with pytest.raises(openai.BadRequestError, match=next(iter(extra))):
        beam_search(client, PROMPTS[0], **extra)


def test_length_penalty_needs_beam_search_and_chat_refuses_it(client):
    with pytest.raises(openai.BadRequestError, match="length_penalty"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4,
                                  extra_body={"length_penalty": 2.0})
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"use_beam_search": True})


def test_too_wide_a_beam_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="beam_width"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=1000, max_tokens=4,
                                  extra_body={"use_beam_search": True})
