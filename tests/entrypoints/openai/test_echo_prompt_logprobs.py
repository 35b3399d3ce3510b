"""Prompt scoring over HTTP (issue 32): `echo` on /v1/completions with OpenAI's legacy logprobs, vLLM's
`prompt_logprobs` on completions and chat, and GET /tokenizer_info, through the openai SDK against a live server.

Every prompt token's logprob is checked against transformers' log-softmax on the same float32 weights within 1e-4.
The server's step budget is 16 tokens, so every prompt here (longer than that) is prefilled in chunks, and
prompt logprobs must be carried across them; a prompt already in the prefix cache must still be scored whole."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.entrypoints.openai.conftest import API_KEY

TOLERANCE = 1e-4
PROMPT = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the dark forest where "
          "nobody can find it again")
OTHER_PROMPT = "Paris is the capital of France, Berlin is the capital of Germany, and Rome is the capital of Italy"
MAX_LOGPROBS = 20


@pytest.fixture(scope="module")
def scoring_server(model_dir, start_server):
    """Steps of at most 16 tokens (chunked prefill splits every prompt here), prefix caching on (the default)."""
    yield from start_server(model_dir, "--api-key", API_KEY, "--max-num-batched-tokens", "16",
                            "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def scoring_client(scoring_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scoring_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Token ids -> transformers' log-softmax over the vocabulary at each position (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax


def expected_prompt_logprobs(reference, ids: list[int]) -> list[float]:
    table = reference(ids)
    return [table[i - 1, ids[i]].item() for i in range(1, len(ids))]


def assert_echo_scores(reference, ids: list[int], prompt_text: str, choice, generated: int = 1,
                       num_top: int = 1) -> None:
    """`choice` echoes the prompt `ids` (text and logprobs with `num_top` top ones), then holds `generated`
    tokens."""
    assert choice.text.startswith(prompt_text)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(ids) + generated
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0
    got = logprobs.token_logprobs[1:len(ids)]
    assert got == pytest.approx(expected_prompt_logprobs(reference, ids), abs=TOLERANCE)
    table = reference(ids)
    for position, top in enumerate(logprobs.top_logprobs[1:len(ids)], start=1):
        # The most likely `num_top` tokens, plus the prompt's own when it is not among them.
        best = table[position - 1].max().item() if num_top else got[position - 1]
        assert max(top.values()) == pytest.approx(best, abs=TOLERANCE)
        assert num_top <= len(top) <= num_top + 1
    if generated:  # greedy: the generated token is the most likely one after the prompt
        assert logprobs.token_logprobs[len(ids)] == pytest.approx(table[-1].max().item(), abs=TOLERANCE)


def test_echo_scores_the_prompt(scoring_client, tokenizer, reference):
    # lm-eval's local-completions loglikelihood request.
    response = scoring_client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=1,
                                                 temperature=0, seed=1234)
    ids = tokenizer.encode(PROMPT)
    assert len(ids) > 16  # more than one step's budget: prefilled in chunks
    assert_echo_scores(reference, ids, PROMPT, response.choices[0])
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 1


def test_echo_of_a_cached_prompt_recomputes_it(scoring_client, tokenizer, reference):
    # As vLLM: a cached prefix has no logits to report, so a scoring request computes its prompt again, and plain
    # requests around it keep hitting the cache.
    ids = tokenizer.encode(OTHER_PROMPT)
    plain = [scoring_client.completions.create(model="tiny", prompt=OTHER_PROMPT, max_tokens=1) for _ in range(2)]
    assert plain[1].usage.prompt_tokens_details.cached_tokens >= 16
    scored = [scoring_client.completions.create(model="tiny", prompt=OTHER_PROMPT, echo=True, logprobs=1,
                                                max_tokens=1, temperature=0) for _ in range(2)]
    for response in scored:
        assert response.usage.prompt_tokens_details.cached_tokens == 0
        assert_echo_scores(reference, ids, OTHER_PROMPT, response.choices[0])
    assert scored[0].choices[0].logprobs == scored[1].choices[0].logprobs
    again = scoring_client.completions.create(model="tiny", prompt=OTHER_PROMPT, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_echo_streams_the_prompt_in_the_first_chunk(scoring_client, tokenizer, reference):
    chunks = list(scoring_client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                                    temperature=0, stream=True))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].text.startswith(PROMPT)
    ids = tokenizer.encode(PROMPT)
    assert len(choices[0].logprobs.tokens) >= len(ids)
    merged = choices[0].model_copy(deep=True)
    for choice in choices[1:]:
        merged.text += choice.text
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(merged.logprobs, name).extend(getattr(choice.logprobs, name))
    assert_echo_scores(reference, ids, PROMPT, merged, generated=3)
    full = scoring_client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                             temperature=0)
    assert merged.text == full.choices[0].text
    assert merged.logprobs.token_logprobs == full.choices[0].logprobs.token_logprobs


def test_echo_a_batch_of_text_and_of_token_prompts(scoring_client, tokenizer, reference):
    prompts = [PROMPT, OTHER_PROMPT]
    ids = [tokenizer.encode(p) for p in prompts]
    by_text = scoring_client.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                                temperature=0)
    by_ids = scoring_client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                               temperature=0)
    for response in (by_text, by_ids):
        assert [c.index for c in response.choices] == [0, 1]
        for choice, prompt_ids in zip(response.choices, ids):
            assert_echo_scores(reference, prompt_ids, tokenizer.decode(prompt_ids), choice)
    assert [c.logprobs for c in by_text.choices] == [c.logprobs for c in by_ids.choices]


def test_echo_without_generation(scoring_client, tokenizer, reference):
    ids = tokenizer.encode(PROMPT)
    response = scoring_client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    choice = response.choices[0]
    assert choice.text == PROMPT
    assert_echo_scores(reference, ids, PROMPT, choice, generated=0, num_top=0)
    assert response.usage.completion_tokens == 0
    streamed = list(scoring_client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0,
                                                      stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT


def test_echo_without_logprobs_and_with_structured_outputs(scoring_client):
    plain = scoring_client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    generated = scoring_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert plain.choices[0].text == PROMPT + generated.choices[0].text and plain.choices[0].logprobs is None
    constrained = scoring_client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=8,
                                                    temperature=0, extra_body={"structured_outputs": {"regex": "ab+"}})
    assert constrained.choices[0].text.startswith(PROMPT)
    assert constrained.choices[0].text[len(PROMPT):].startswith("ab")


def _check_vllm_prompt_logprobs(entries: list, ids: list[int], reference, num_top: int) -> None:
    """vLLM's shape: None first, then per position the prompt token and the `num_top` most likely ones."""
    assert entries[0] is None and len(entries) == len(ids)
    table = reference(ids)
    for position, entry in enumerate(entries[1:], start=1):
        token = str(ids[position])
        assert token in entry and len(entry) <= num_top + 1
        assert entry[token]["logprob"] == pytest.approx(table[position - 1, ids[position]].item(), abs=TOLERANCE)
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked if e is not entry[token]][:num_top] == list(range(1, num_top + 1))
        top = table[position - 1].topk(num_top)
        for rank, (value, token_id) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[str(token_id)]["logprob"] == pytest.approx(value, abs=TOLERANCE)
            assert entry[str(token_id)]["rank"] == rank and isinstance(entry[str(token_id)]["decoded_token"], str)


def test_prompt_logprobs_on_completions(scoring_client, tokenizer, reference):
    response = scoring_client.completions.create(model="tiny", prompt=[PROMPT, OTHER_PROMPT], max_tokens=1,
                                                 extra_body={"prompt_logprobs": 3})
    for choice, prompt in zip(response.choices, [PROMPT, OTHER_PROMPT]):
        _check_vllm_prompt_logprobs(choice.model_extra["prompt_logprobs"], tokenizer.encode(prompt), reference, 3)
    # With echo the prompt tokens get as many top logprobs as the generated ones, the field only what it asked.
    echoed = scoring_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=5,
                                               extra_body={"prompt_logprobs": 1})
    _check_vllm_prompt_logprobs(echoed.choices[0].model_extra["prompt_logprobs"], tokenizer.encode(PROMPT),
                                reference, 1)
    assert all(len(top) >= 5 for top in echoed.choices[0].logprobs.top_logprobs[1:])


def test_prompt_logprobs_on_chat(scoring_client, tokenizer, reference):
    messages = [{"role": "user", "content": PROMPT}]
    response = scoring_client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                                      extra_body={"prompt_logprobs": 2})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    _check_vllm_prompt_logprobs(response.model_extra["prompt_logprobs"], list(ids), reference, 2)


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ({"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": PROMPT, "max_tokens": 1, "echo": True, "use_beam_search": True, "n": 2, "temperature": 0}, "echo"),
    ({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1, "use_beam_search": True, "n": 2, "temperature": 0},
     "prompt_logprobs"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 0, "echo": True, "use_beam_search": True, "n": 2}, "echo"),
])
def test_refused_scoring_requests_name_the_field(scoring_server, body, param):
    response = httpx.post(f"{scoring_server.url}/v1/completions", json={"model": "tiny", **body},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("prompt", [[5, -267, 9], [5, 3659303201344], [10 ** 9, 3]],
                         ids=["negative", "huge", "past-vocab"])
def test_echo_of_token_ids_outside_the_vocabulary_is_refused(scoring_server, prompt):
    """Echo decodes the ids before the engine sees them: they are checked first (found by schemathesis: a 500)."""
    response = httpx.post(f"{scoring_server.url}/v1/completions", timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "echo": True})
    assert response.status_code == 400 and "out of range" in response.json()["error"]["message"], response.text


def test_refused_chat_prompt_logprobs_name_the_field(scoring_server):
    for extra in ({"prompt_logprobs": MAX_LOGPROBS + 1}, {"prompt_logprobs": 1, "stream": True}):
        response = httpx.post(f"{scoring_server.url}/v1/chat/completions", timeout=30,
                              json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **extra},
                              headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs", response.text


def test_no_blocks_are_leaked(scoring_server, scoring_client):
    # Last in the module: every request above, served or refused, has let go of its KV blocks.
    metrics = scoring_server.wait_until_idle()
    assert metrics[("pagellm:kv_cache_usage_perc", ())] == 0
    assert metrics[("pagellm:num_requests_running", ())] == 0


def test_tokenizer_info(scoring_server, tokenizer):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{scoring_server.url}/tokenizer_info", timeout=30).status_code == 401
    info = httpx.get(f"{scoring_server.url}/tokenizer_info", headers=headers, timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert "vocab_file" not in info
