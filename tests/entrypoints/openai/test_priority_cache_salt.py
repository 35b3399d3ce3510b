"""The server's per-request options of issue 10: `priority` and `cache_salt` on both endpoints reach the engine's
requests or are refused with a 400 naming the field and the flag to change, and the usage block reports the
prompt tokens the prefix cache supplied (`prompt_tokens_details.cached_tokens`, streamed usage included) and
/metrics counts them."""
from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai.api_server import ServerConfig, build_app

MODEL_NAME = "tiny"  # as served by the `server` fixture
BLOCK_SIZE = 16  # the server's (EngineArgs' default)
LONG_PROMPT_LEN = 40  # two full blocks and a partial one
MESSAGES = [{"role": "user", "content": "Hi there"}]
ENDPOINTS = {"completions": {"prompt": "Hello"}, "chat": {"messages": MESSAGES}}


def create(client: openai.OpenAI, endpoint: str, **fields):
    """A short greedy request to `endpoint` ("completions" or "chat"); `fields` beyond the prompt go in the body."""
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, **ENDPOINTS[endpoint]}
    body.update({k: fields.pop(k) for k in ("prompt", "messages", "stream", "stream_options") if k in fields})
    api = client.completions if endpoint == "completions" else client.chat.completions
    return api.create(**body, extra_body=fields)


def streamed_usage(client: openai.OpenAI, endpoint: str, **fields):
    chunks = list(create(client, endpoint, stream=True, stream_options={"include_usage": True}, **fields))
    return chunks[-1].usage


def full_block_tokens(num_prompt_tokens: int) -> int:
    """The prompt tokens a full prefix-cache hit supplies: whole blocks, never the last token."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def cached_tokens(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


# ------------------------------------------------------------------------- the shared server: FCFS, prefix caching
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_nonzero_priority_is_a_400_under_fcfs(client, endpoint):
    with pytest.raises(openai.BadRequestError) as failure:
        create(client, endpoint, priority=1)
    assert failure.value.body["param"] == "priority"
    assert "--scheduling-policy priority" in failure.value.body["message"]
    assert create(client, endpoint, priority=0).usage.completion_tokens == 2


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("salt", ["", 5])
def test_a_bad_cache_salt_is_a_400(client, endpoint, salt):
    with pytest.raises(openai.BadRequestError) as failure:
        create(client, endpoint, cache_salt=salt)
    assert failure.value.body["param"] == "cache_salt"


def test_a_repeated_completion_reports_cached_tokens(server, client, make_token_prompts):
    prompt = make_token_prompts([LONG_PROMPT_LEN], seed=11)[0]["prompt_token_ids"]
    fresh = make_token_prompts([LONG_PROMPT_LEN], seed=12)[0]["prompt_token_ids"]
    before = server.metrics()
    first = create(client, "completions", prompt=prompt)
    second = create(client, "completions", prompt=prompt)
    assert cached_tokens(first.usage) == 0
    assert cached_tokens(second.usage) == full_block_tokens(LONG_PROMPT_LEN)
    assert second.choices[0].text == first.choices[0].text
    assert cached_tokens(streamed_usage(client, "completions", prompt=prompt)) == full_block_tokens(LONG_PROMPT_LEN)
    # A batch's usage adds up its prompts: one cached, one new.
    assert cached_tokens(create(client, "completions", prompt=[prompt, fresh]).usage) == full_block_tokens(
        LONG_PROMPT_LEN)
    after = server.wait_until_idle()
    hits = after[("pagellm:prefix_cache_hits_total", ())] - before[("pagellm:prefix_cache_hits_total", ())]
    queries = after[("pagellm:prefix_cache_queries_total", ())] - before[("pagellm:prefix_cache_queries_total", ())]
    assert hits == 3 * full_block_tokens(LONG_PROMPT_LEN)
    assert queries >= 5 * (LONG_PROMPT_LEN - 1)  # five prompts looked up


def test_a_repeated_chat_reports_cached_tokens(client):
    messages = [{"role": "user", "content": "Tell me about paged attention and prefix caching, " * 3}]
    first = create(client, "chat", messages=messages)
    expected = full_block_tokens(first.usage.prompt_tokens)
    # The chat template's opening may already be cached from earlier chats; never more than the full blocks.
    assert 0 <= cached_tokens(first.usage) <= expected
    assert cached_tokens(create(client, "chat", messages=messages).usage) == expected
    assert cached_tokens(streamed_usage(client, "chat", messages=messages)) == expected


def test_cache_salt_separates_cached_prefixes(client, make_token_prompts):
    prompt = make_token_prompts([LONG_PROMPT_LEN], seed=13)[0]["prompt_token_ids"]

    def num_cached(**salt) -> int:
        return cached_tokens(create(client, "completions", prompt=prompt, **salt).usage)

    assert num_cached(cache_salt="tenant-a") == 0
    assert num_cached() == 0
    assert num_cached(cache_salt="tenant-b") == 0
    assert num_cached(cache_salt="tenant-a") == full_block_tokens(LONG_PROMPT_LEN)


# ------------------------------------------------------------------------ in-process apps with other engine settings
def engine_with(model_dir, **engine_args) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=model_dir, max_model_len=128, kv_cache_memory_bytes=1 << 20,
                                                 **engine_args))


def app_client(engine: LLMEngine) -> TestClient:
    return TestClient(build_app(AsyncLLM.from_engine(engine, log_stats=False),
                                ServerConfig(served_model_names=[MODEL_NAME])))


@pytest.fixture(scope="module")
def priority_engine(model_dir) -> LLMEngine:
    return engine_with(model_dir, scheduling_policy="priority")


@pytest.fixture(scope="module")
def uncached_engine(model_dir) -> LLMEngine:
    return engine_with(model_dir, enable_prefix_caching=False)


def test_priority_and_cache_salt_reach_the_engine(priority_engine, monkeypatch):
    core = priority_engine.engine_core
    add_request, requests = core.add_request, []

    def recording_add_request(request, *args):
        requests.append(request)
        add_request(request, *args)

    monkeypatch.setattr(core, "add_request", recording_add_request)
    with app_client(priority_engine) as http:
        batch = http.post("/v1/completions", json={"prompt": ["Hello", "Bye"], "max_tokens": 2, "priority": 5,
                                                   "cache_salt": "s1"})
        assert batch.status_code == 200, batch.text
        chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "priority": -2})
        assert chat.status_code == 200, chat.text
    assert [(r.priority, r.cache_salt) for r in requests] == [(5, "s1"), (5, "s1"), (-2, None)]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Hello"}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})])
def test_cache_salt_without_prefix_caching_is_a_400(uncached_engine, path, body):
    with app_client(uncached_engine) as http:
        refused = http.post(path, json={**body, "max_tokens": 2, "cache_salt": "s"})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "cache_salt" and "--no-enable-prefix-caching" in error["message"]
        served = http.post(path, json={**body, "max_tokens": 2})
        assert served.status_code == 200 and served.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
