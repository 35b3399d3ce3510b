"""Bad requests over raw HTTP: each gets an OpenAI error body with the right status (never a stack trace), and
the server goes on serving a good request after it. Also auth, and the small endpoints' shapes."""
from __future__ import annotations

import json

import httpx
import pytest

GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.api_key}"},
                      timeout=30) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and "Traceback" not in error["message"]
    if param != "any":
        assert error["param"] == param
    return error


def assert_still_serving(http) -> None:
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", dict(GOOD, temperature=-1), "temperature"),
    ("/v1/completions", dict(GOOD, top_p=2), "top_p"),
    ("/v1/completions", dict(GOOD, n=0), "n"),
    ("/v1/completions", dict(GOOD, max_tokens=0), "max_tokens"),
    ("/v1/completions", dict(GOOD, presence_penalty=5), "presence_penalty"),
    ("/v1/completions", dict(GOOD, logit_bias={"not-a-token": 1}), "logit_bias"),
    ("/v1/completions", dict(GOOD, logit_bias={"99999999": 1}), "logit_bias"),
    ("/v1/completions", dict(GOOD, logprobs=50), "logprobs"),
    ("/v1/completions", dict(GOOD, temperature="hot"), "temperature"),
    ("/v1/completions", dict(GOOD, prompt=None), "prompt"),
    ("/v1/completions", dict(GOOD, prompt=[]), "prompt"),
    ("/v1/completions", dict(GOOD, prompt=[-5, 3]), None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("/v1/completions", dict(GOOD, prompt="hi " * 300), "prompt"),
    ("/v1/completions", dict(GOOD, max_tokens=250, prompt="hi " * 10), "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "stream": "yes please"}, "stream"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}, "messages"),
    ("/tokenize", {"model": "tiny"}, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    # Values that once reached the engine thread and stopped it for everyone (int64 overflows, ids outside the
    # vocabulary), and non-finite floats that were silently accepted.
    ("/v1/completions", dict(GOOD, seed=2**64), "seed"),
    ("/v1/completions", dict(GOOD, seed=2**70), "seed"),
    ("/v1/completions", dict(GOOD, seed=2**63 - 1, n=2), "seed"),
    ("/v1/completions", dict(GOOD, top_k=2**63), "top_k"),
    ("/v1/completions", dict(GOOD, stop_token_ids=[10**9], min_tokens=1), "stop_token_ids"),
    ("/v1/completions", dict(GOOD, stop_token_ids=[2**64], min_tokens=1), "stop_token_ids"),
    ("/v1/completions", dict(GOOD, priority=2**63), "priority"),
    ("/v1/completions", dict(GOOD, max_tokens=2**64), "max_tokens"),
    ("/v1/completions", dict(GOOD, temperature=float("nan")), "temperature"),
    ("/v1/completions", dict(GOOD, temperature=float("inf")), "temperature"),
    ("/v1/completions", dict(GOOD, repetition_penalty=float("inf")), "repetition_penalty"),
    ("/v1/completions", dict(GOOD, logit_bias={"5": float("nan")}), "logit_bias"),
    ("/v1/completions", dict(GOOD, n=65), "n"),  # more than --max-num-seqs 64
    ("/v1/completions", dict(GOOD, logprobs=21), "logprobs"),  # more than --max-logprobs 20
    # Options that would change the result but are not implemented: refused, never ignored.
    ("/v1/completions", dict(GOOD, guided_json={"type": "object"}), "guided_json"),
    ("/v1/completions", dict(GOOD, response_format={"type": "xml"}), "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "guided_regex": "a+"},
     "guided_regex"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, "tools"),
    # Text that is not valid Unicode, nesting deep enough to exhaust a recursive walk, lists that would cost
    # work per step.
    ("/v1/completions", dict(GOOD, prompt="\ud800"), "prompt"),
    ("/v1/completions", dict(GOOD, prompt=["fine", "\udfff\ud800"]), "prompt"),
    ("/v1/completions", dict(GOOD, bad_words=["\ud800"]), "bad_words"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", dict(GOOD, stop=json.loads("[" * 900 + "]" * 900)), "stop"),
    ("/v1/completions", dict(GOOD, bad_words=["word"] * 257), "bad_words"),
    ("/v1/completions", dict(GOOD, stop=["x"] * 65), "stop"),
    ("/v1/completions", dict(GOOD, prompt=["Hi"] * 4097), "prompt"),
])
def test_bad_parameters_are_400(http, path, body, param):
    # Python's json writes NaN and Infinity as JSON's popular extension does; httpx's json= would refuse them.
    response = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert_error(response, 400, param)
    assert_still_serving(http)


def test_deeply_nested_unknown_fields_are_ignored(http):
    body = json.dumps(dict(GOOD, junk=json.loads("[" * 900 + "]" * 900)))
    response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


def test_streaming_request_with_bad_parameters_is_400_before_the_stream(http):
    assert_error(http.post("/v1/completions", json=dict(GOOD, stream=True, top_p=0)), 400, "top_p")
    assert_still_serving(http)


@pytest.mark.parametrize("content", [b'{"prompt": "Hello",', b"not json at all", b"[1, 2, 3]", b""])
def test_malformed_json_is_400(http, content):
    response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_error(response, 400)
    assert_still_serving(http)


def test_unknown_model_is_404(http):
    error = assert_error(http.post("/v1/completions", json=dict(GOOD, model="gpt-5")), 404, "model")
    assert "gpt-5" in error["message"]
    assert_error(http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user",
                                                                                       "content": "hi"}]}), 404)
    assert_still_serving(http)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}])
def test_auth(server, http, headers):
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
        response = httpx.request(method, server.url + path, json=GOOD, headers=headers, timeout=30)
        assert_error(response, 401)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path, headers=headers, timeout=30).status_code == 200
    assert_still_serving(http)


def test_models_version_and_unknown_route(server, http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server.model_name, server.alias]
    assert models["data"][0]["max_model_len"] == 256
    assert http.get("/version").json()["version"]
    assert_error(http.get("/v1/nothing-here"), 404)


def test_tokenize_and_detokenize(http, tokenizer):
    tokens = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokens["tokens"] == tokenizer.encode("Hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
