"""The app in-process (FastAPI's TestClient) over a tiny engine: --chat-template as a file or inline Jinja, and
an engine whose step fails (the request in flight gets a 503 error body without the trace, /health turns 503,
later requests are refused rather than left hanging)."""
from __future__ import annotations

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
    return TestClient(build_app(AsyncLLM(engine, log_stats=False), ServerConfig(served_model_names=["tiny"], **config)))


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
