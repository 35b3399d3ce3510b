"""The app in-process (FastAPI's TestClient) over a tiny engine: --chat-template as a file or inline Jinja (and
sandboxed), a request that fails inside the engine (it alone gets a 500 while concurrent streams finish), and an
engine that dies (the request in flight gets a 503 error body without the trace, /health turns 503, later requests
are refused rather than left hanging)."""
from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai.api_server import ServerConfig, build_app

BODY = {"prompt": "Hello", "max_tokens": 4}
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=model_dir, max_model_len=128, kv_cache_memory_bytes=1 << 20))


def app_client(engine: LLMEngine, **config) -> TestClient:
    return TestClient(build_app(AsyncLLM.from_engine(engine, log_stats=False),
                                ServerConfig(served_model_names=["tiny"], **config)))


@pytest.mark.parametrize("as_file", [True, False])
def test_chat_template_flag(engine, tokenizer, tmp_path, as_file):
    template = TEMPLATE
    if as_file:
        (tmp_path / "template.jinja").write_text(TEMPLATE)
        template = str(tmp_path / "template.jinja")
    with app_client(engine, chat_template=template) as client:
        tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert tokens == tokenizer.encode("<user>Hi there\n>", add_special_tokens=False)
        chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3}).json()
        assert chat["usage"]["prompt_tokens"] == len(tokens)


def test_engine_failure_turns_health_503(engine, monkeypatch):
    with app_client(engine) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=BODY).status_code == 200

        def broken_step():
            raise RuntimeError("simulated device failure")

        monkeypatch.setattr(engine.engine_core, "step", broken_step)
        failed = client.post("/v1/completions", json=BODY)
        assert failed.status_code == 503
        error = failed.json()["error"]
        assert "internal error" in error["message"] and "simulated" not in error["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == 503
        refused = client.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert refused.status_code == 503
        assert client.get("/metrics").status_code == 200  # still scrapeable


def test_a_sandboxed_chat_template_cannot_reach_python_internals(engine, tmp_path):
    hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with app_client(engine, chat_template=hostile) as client:
        refused = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "messages" and "unsafe" in error["message"] and "subclasses" not in error["message"]
        assert client.post("/v1/completions", json=BODY).status_code == 200


def test_a_request_that_fails_in_the_engine_fails_alone(engine, monkeypatch):
    """A request whose sampling raises inside the step: its non-streaming call gets a 500 (OpenAI error body, no
    details), its stream ends with an error event; concurrent streams finish with the text they get without the
    fault, the engine keeps serving and no block is held afterwards."""
    marker = [4, 4, 4, 4]  # prompt token ids that make sampling fail
    sampler = engine.engine_core.executor.worker.model_runner.batch_sampler
    sample_rows = sampler.sample_rows

    def faulty(logits, requests, rows, *rest):
        if any(requests[row].prompt_token_ids == marker for row in rows):
            raise RuntimeError("injected fault")
        return sample_rows(logits, requests, rows, *rest)

    good = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with app_client(engine) as client:
        expected = client.post("/v1/completions", json=good).json()["choices"][0]["text"]
        monkeypatch.setattr(sampler, "sample_rows", faulty)
        results: dict[str, object] = {}

        def stream(name: str, body: dict) -> None:
            with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as response:
                results[name] = (response.status_code, list(response.iter_lines()))

        def full(name: str, body: dict) -> None:
            response = client.post("/v1/completions", json=body)
            results[name] = (response.status_code, response.json())

        bad = dict(good, prompt=marker)
        threads = [threading.Thread(target=stream, args=(f"good-{i}", good)) for i in range(3)]
        threads += [threading.Thread(target=stream, args=("bad-stream", bad)),
                    threading.Thread(target=full, args=("bad-full", bad))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i in range(3):
            status, lines = results[f"good-{i}"]
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
        status, body = results["bad-full"]
        assert status == 500 and body["error"]["code"] == 500 and "injected" not in body["error"]["message"]
        status, lines = results["bad-stream"]
        # The first output fails, before the response starts: the stream's request is a 500 too.
        assert status == 500 or any('"code": 500' in line for line in lines)
        assert client.get("/health").status_code == 200
        monkeypatch.undo()
        assert client.post("/v1/completions", json=good).json()["choices"][0]["text"] == expected
        metrics = client.get("/metrics").text
        assert ('pagellm:request_success_total{endpoint="/v1/completions",engine="0",finished_reason="error",'
                'model_name="tiny"} 2.0') in metrics
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


# A template that reads a variable of chat_template_kwargs and lists the tools' names.
KWARGS_TEMPLATE = ("{% if greeting is defined %}{{ greeting }}\n{% endif %}"
                   "{% for tool in tools or [] %}[{{ tool.function.name }}]{% endfor %}" + TEMPLATE)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_tokenize_chat_form_takes_the_chat_fields(engine, tokenizer):
    """vLLM's TokenizeChatRequest: chat_template_kwargs, tools and continue_final_message reach the template, and
    the count equals the chat endpoint's prompt_tokens for the same fields."""
    messages = MESSAGES + [{"role": "assistant", "content": "Hello, I"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"greeting": "Hey"}, "tools": TOOLS}
    with app_client(engine, chat_template=KWARGS_TEMPLATE) as client:
        tokens = client.post("/tokenize", json=body).json()["tokens"]
        # The last message is left open: no newline after it.
        assert tokens == tokenizer.encode("Hey\n[get_weather]<user>Hi there\n<assistant>Hello, I",
                                          add_special_tokens=False)
        chat = client.post("/v1/chat/completions", json={**body, "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == len(tokens)
        for bad, param in [({"add_generation_prompt": True}, "continue_final_message"),
                           ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                           ({"chat_template": "{{ messages }}"}, "chat_template")]:
            for path in ("/tokenize", "/v1/chat/completions"):
                response = client.post(path, json={**body, **bad})
                assert response.status_code == 400 and param in response.json()["error"]["message"], (path, bad)
