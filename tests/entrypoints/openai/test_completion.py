"""/v1/completions through the official openai SDK: streaming equals non-streaming, n, stop, seeds, logprobs and
usage counted independently with the tokenizer."""
from __future__ import annotations

import math

MODEL_NAME = "tiny"  # as served by the `server` fixture (its alias: server.alias)
PROMPT = "The capital of France is"


def greedy(client, prompt=PROMPT, max_tokens=12, extra_body=None, **kwargs):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, **(extra_body or {})}, **kwargs)


def test_completion_usage_counts_tokens(client, tokenizer):
    response = greedy(client, max_tokens=10)
    choice = response.choices[0]
    assert response.model == MODEL_NAME and response.object == "text_completion"
    assert choice.finish_reason == "length" and choice.index == 0
    assert response.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert response.usage.completion_tokens == 10
    assert response.usage.total_tokens == response.usage.prompt_tokens + 10
    assert choice.text


def test_alias_model_name_and_token_id_prompt(server, client, tokenizer):
    text = greedy(client).choices[0].text
    by_ids = client.completions.create(model=server.alias, prompt=tokenizer.encode(PROMPT), max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.model == server.alias
    assert by_ids.choices[0].text == text


def test_stream_equals_non_stream_with_usage(client, tokenizer):
    expected = greedy(client, max_tokens=16)
    chunks = list(greedy(client, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_batch_of_prompts_matches_single_requests(client):
    prompts = [PROMPT, "def fibonacci(n):", "Once upon a time"]
    batch = greedy(client, prompt=prompts)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [greedy(client, prompt=p).choices[0].text for p in prompts]
    assert batch.usage.completion_tokens == 3 * 12


def test_n_samples_non_stream_and_stream(client):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0,
                                         seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 16
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0,
                                           seed=3, stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "length", 1: "length"}
    assert texts == {c.index: c.text for c in response.choices}  # same seed, same samples


def test_stop_string_cuts_the_text(client):
    full = greedy(client, max_tokens=16).choices[0].text
    stop = full[6:9]
    response = greedy(client, max_tokens=16, stop=[stop])
    choice = response.choices[0]
    assert choice.text == full[:full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


def test_seed_reproducible_at_temperature_one(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


def test_logprobs_shape_and_values(client):
    response = greedy(client, max_tokens=8, logprobs=3)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert logprobs.text_offset[0] == 0
    for i, (token, value, top) in enumerate(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)):
        assert value <= 0 and math.isfinite(value)
        assert 3 <= len(top) <= 4
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        assert top[token] == value  # the chosen token is among them, with the same logprob
        assert value == max(values)  # greedy: the chosen token is the most likely
        if i + 1 < len(logprobs.tokens):
            assert logprobs.text_offset[i + 1] == logprobs.text_offset[i] + len(token)


def test_sampling_extras_reach_the_sampler(client, tokenizer):
    text = greedy(client).choices[0].text
    top_k_1 = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11,
                                        extra_body={"ignore_eos": True, "top_k": 1})
    assert top_k_1.choices[0].text == text  # top_k=1 is greedy at any temperature
    forced = tokenizer.encode(" banana")[0]
    biased = greedy(client, max_tokens=4, logit_bias={str(forced): 100}, logprobs=0)
    assert biased.choices[0].text == tokenizer.decode([forced] * 4)
    stopped = greedy(client, extra_body={"stop_token_ids": [forced]}, logit_bias={str(forced): 100})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == forced
