"""`request_success_total` by endpoint: one request through each API that runs the engine (the app in-process over a
tiny engine), read back from /metrics with prometheus_client's own parser. A /v1/batches job's lines count under
/v1/batches, not under the endpoint each line names."""
from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai.api_server import ServerConfig, build_app
from pagellm.entrypoints.openai.endpoint_label import ENGINE_ENDPOINTS

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
MESSAGES = [{"role": "user", "content": "Hi there"}]
# (path, body, requests it runs in the engine, their finish reason where it is known)
CALLS = [
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "ignore_eos": True}, 2, "length"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True}, 1, "length"),
    ("/v1/embeddings", {"input": ["one", "two", "three"]}, 3, "stop"),
    ("/score", {"text_1": "q", "text_2": ["x", "y"]}, 2, "stop"),
    ("/v1/rerank", {"query": "q", "documents": ["x"]}, 1, "stop"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}, 1, None),
    ("/v1/messages", {"max_tokens": 2, "messages": MESSAGES}, 1, None),
]


def success(client: TestClient) -> dict[tuple[str, str], float]:
    """{(endpoint, finished_reason): count} of pagellm:request_success_total."""
    text = client.get("/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "pagellm:request_success")
    return {(s.labels["endpoint"], s.labels["finished_reason"]): s.value for s in family.samples
            if s.name == "pagellm:request_success_total"}


@pytest.fixture(scope="module")
def client(model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, max_model_len=128, kv_cache_memory_bytes=1 << 20))
    app = build_app(AsyncLLM.from_engine(engine, log_stats=False),
                    ServerConfig(served_model_names=["tiny"], chat_template=TEMPLATE))
    with TestClient(app) as client:
        yield client


def test_every_endpoint_counts_its_requests(client):
    before = success(client)
    assert {endpoint for endpoint, _ in before} == set(ENGINE_ENDPOINTS)  # exported from the start, at 0
    for path, body, count, reason in CALLS:
        assert client.post(path, json={"model": "tiny", **body}).status_code == 200, path
        after = success(client)
        grown = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
        assert {endpoint for endpoint, _ in grown} == {path}, grown
        assert sum(grown.values()) == count, (path, grown)
        if reason is not None:
            assert {r for _, r in grown} == {reason}, (path, grown)
        before = after


def test_batch_lines_count_under_batches(client):
    before = success(client)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}} for i in range(3)]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    file_id = client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()
    deadline = time.monotonic() + 60
    while client.get(f"/v1/batches/{batch['id']}").json()["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = success(client)
    assert after[("/v1/batches", "length")] - before[("/v1/batches", "length")] == 3
    assert after[("/v1/completions", "length")] == before[("/v1/completions", "length")]
