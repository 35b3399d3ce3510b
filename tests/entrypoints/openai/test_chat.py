"""/v1/chat/completions through the official openai SDK: the chat template, streaming equals non-streaming, n,
logprobs and usage counted independently with the tokenizer."""
from __future__ import annotations

import math

MODEL_NAME = "tiny"  # as served by the `server` fixture
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]


def chat(client, **kwargs):
    kwargs.setdefault("max_completion_tokens", 12)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, extra_body={"ignore_eos": True},
                                          **kwargs)


def test_chat_uses_the_template_and_counts_usage(client, tokenizer):
    response = chat(client)
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 12
    # The same prompt as raw token ids through /v1/completions gives the same greedy text.
    completion = client.completions.create(model=MODEL_NAME, prompt=list(prompt_ids), max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == choice.message.content


def test_deprecated_max_tokens(client):
    assert chat(client, max_completion_tokens=None, max_tokens=5).usage.completion_tokens == 5


def test_chat_stream_equals_non_stream(client):
    expected = chat(client, max_completion_tokens=16).choices[0].message.content
    chunks = list(chat(client, max_completion_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_chat_n_streamed(client):
    contents: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in chat(client, n=2, temperature=1.0, seed=5, max_completion_tokens=6, stream=True):
        for choice in chunk.choices:
            contents[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    response = chat(client, n=2, temperature=1.0, seed=5, max_completion_tokens=6)
    assert {c.index: c.message.content for c in response.choices} == contents


def test_chat_logprobs_shape_and_values(client):
    response = chat(client, logprobs=True, top_logprobs=3, max_completion_tokens=6)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and tops[0] == entry.logprob  # greedy: the argmax
    plain = chat(client, logprobs=True, max_completion_tokens=3).choices[0].logprobs.content
    assert all(entry.top_logprobs == [] for entry in plain)
    assert chat(client, max_completion_tokens=3).choices[0].logprobs is None
