"""`/v1/files` and `/v1/batches` with the openai SDK against the shared server (API key required, so the batch's
lines must carry the submitter's key): a batch's output lines equal the same requests sent directly (greedy), a
line the endpoint refuses lands in the error file, files list / retrieve / delete, bad ids are 404s."""
from __future__ import annotations

import argparse
import io
import json
import time

import openai
import pytest
from fastapi.testclient import TestClient

from pagellm.benchmarks import serve as bench
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.api_server import ServerConfig, build_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "The capital of", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def served_model(client) -> str:
    return client.models.list().data[0].id


def _upload(client, lines: list[dict]):
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")


def _wait(client, batch_id: str):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def _lines(client, file_id: str) -> dict[str, dict]:
    return {line["custom_id"]: line for line in map(json.loads, client.files.content(file_id).text.splitlines())}


def test_chat_batch_matches_direct_requests(client, served_model):
    bodies = {f"req-{i}": {**CHAT, "model": served_model,
                           "messages": [{"role": "user", "content": f"Count to {i}"}]} for i in range(4)}
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
             for cid, body in bodies.items()]
    lines.append({"custom_id": "refused", "method": "POST", "url": "/v1/chat/completions",
                  "body": {**CHAT, "model": served_model, "max_tokens": -1}})
    uploaded = _upload(client, lines)
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status in ("validating", "in_progress")
    batch = _wait(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 4, 1)
    outputs = _lines(client, batch.output_file_id)
    assert set(outputs) == set(bodies)
    for cid, body in bodies.items():
        direct = client.chat.completions.create(**body).model_dump()
        got = outputs[cid]["response"]
        assert got["status_code"] == 200 and outputs[cid]["error"] is None
        assert got["body"]["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
        assert got["body"]["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    errors = _lines(client, batch.error_file_id)
    assert errors["refused"]["response"]["status_code"] == 400
    assert any(b.id == batch.id for b in client.batches.list().data)


def test_completion_batch_and_files_api(client, served_model):
    body = {**COMPLETION, "model": served_model}
    uploaded = _upload(client, [{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}])
    batch = _wait(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                completion_window="24h").id)
    assert batch.status == "completed" and batch.error_file_id is None
    got = _lines(client, batch.output_file_id)["a"]["response"]["body"]
    assert got["choices"][0]["text"] == client.completions.create(**body).choices[0].text

    assert client.files.retrieve(uploaded.id).filename == "requests.jsonl"
    assert uploaded.id in {f.id for f in client.files.list().data}
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_batch_whose_line_names_another_endpoint_fails(client, served_model):
    uploaded = _upload(client, [{"custom_id": "x", "method": "POST", "url": "/v1/completions",
                                 "body": {**COMPLETION, "model": served_model}}])
    batch = _wait(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                completion_window="24h").id)
    assert batch.status == "failed" and batch.errors.data[0].line == 1


def test_bad_ids_and_purpose(client):
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")


def test_bench_serve_background_batch_smoke(server, model_dir, capsys):
    """`bench serve --background-batch`: the second run goes beside a batch the server accepted (no timings)."""
    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    metrics = bench.run(parser.parse_args([
        "--disable-tqdm", "--base-url", server.url, "--api-key", server.api_key, "--tokenizer", str(model_dir),
        "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4", "--background-batch", "5"]))
    background = metrics["background_batch"]
    assert background["completed"] == 3 and background["failed"] == 0
    assert background["batch_request_counts"]["total"] == 5
    assert background["batch_status"] in ("in_progress", "completed")
    assert "Interactive TTFT with a background batch" in capsys.readouterr().out


def _start_completion_batch(client: TestClient, body: dict, count: int) -> dict:
    """A /v1/batches job of `count` completion lines with this body, through the HTTP API; returns it once past
    validation."""
    lines = "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions", "body": body})
                    + "\n" for i in range(count))
    file_id = client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("b.jsonl", lines.encode())}).json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()
    while client.get(f"/v1/batches/{batch['id']}").json()["status"] == "validating":
        time.sleep(0.01)
    return batch


def test_interactive_request_goes_ahead_of_batch_lines_under_priority_policy(model_dir):
    """One sequence per step and --scheduling-policy priority: the batch's lines carry a large priority, so an
    interactive request sent once the batch runs finishes while most of the batch still waits (under fcfs it would
    queue behind all of them)."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), max_model_len=128, max_num_seqs=1,
                                                  kv_cache_memory_bytes=1 << 20, scheduling_policy="priority"),
                                       log_stats=False)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    with TestClient(build_app(engine, ServerConfig(served_model_names=["tiny"]))) as client:
        batch = _start_completion_batch(client, body, 8)
        interactive = client.post("/v1/completions", json={**body, "max_tokens": 4})
        counts = client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]
        assert interactive.status_code == 200
        assert counts["completed"] < counts["total"] - 2
        while (batch := client.get(f"/v1/batches/{batch['id']}").json())["status"] == "in_progress":
            time.sleep(0.05)
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 8


def _metric(client, prefix: str) -> float:
    """The sum of the /metrics samples whose line starts with `prefix` (a name and a label or two)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
               if line.startswith(prefix))


def test_cancel_aborts_the_lines_in_flight(model_dir):
    """A cancelled batch's running lines are aborted in the engine, not left to finish."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), max_model_len=128, max_num_seqs=1,
                                                  kv_cache_memory_bytes=1 << 20), log_stats=False)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True}
    with TestClient(build_app(engine, ServerConfig(served_model_names=["tiny"]))) as client:
        batch = _start_completion_batch(client, body, 6)
        cancelled = client.post(f"/v1/batches/{batch['id']}/cancel").json()
        assert cancelled["status"] == "cancelled"
        while _metric(client, "pagellm:num_requests_running{") + _metric(client, "pagellm:num_requests_waiting{"):
            time.sleep(0.05)
        # Without the abort all 6 lines would run to max_tokens ("length"); the series exists from the start (0).
        prefix = 'pagellm:request_success_total{endpoint="/v1/batches",engine="0",finished_reason="length"'
        assert any(line.startswith(prefix) for line in client.get("/metrics").text.splitlines())
        assert _metric(client, prefix) < 6
        assert client.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
