"""`pagellm run-batch` through its main function over the tiny random-weight Llama: each output line's body
equals the same request sent directly to the app (greedy), a rerun skips the custom_ids already answered, and a
line that is not a batch request or names a url the server lacks gets an error line rather than stopping the run."""
from __future__ import annotations

import json

from fastapi.testclient import TestClient

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.cli import main
from pagellm.entrypoints.openai.api_server import ServerConfig, build_app

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"prompt": "The capital of", "max_tokens": 6, "temperature": 0}
ENGINE_FLAGS = ["--max-model-len", "128", "--kv-cache-memory", str(1 << 20)]


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(model_dir, source, output) -> int:
    return main(["run-batch", "-i", str(source), "-o", str(output), "--model", str(model_dir),
                 "--served-model-name", "tiny", "--disable-progress-bar", *ENGINE_FLAGS])


def _direct(model_dir) -> dict[str, dict]:
    """The same requests sent straight to a fresh app over the same weights."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), max_model_len=128,
                                                  kv_cache_memory_bytes=1 << 20), log_stats=False)
    with TestClient(build_app(engine, ServerConfig(served_model_names=["tiny"]))) as client:
        return {"chat": client.post("/v1/chat/completions", json=CHAT).json(),
                "completion": client.post("/v1/completions", json=COMPLETION).json()}


def _choices(body: dict) -> list:
    return body["choices"]


def test_run_batch_outputs_resume_and_errors(model_dir, tmp_path):
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join([_line("chat", "/v1/chat/completions", CHAT),
                                 _line("completion", "/v1/completions", COMPLETION)]) + "\n")
    assert _run(model_dir, source, output) == 0
    first = [json.loads(text) for text in output.read_text().splitlines()]
    by_id = {line["custom_id"]: line for line in first}
    assert set(by_id) == {"chat", "completion"}
    direct = _direct(model_dir)
    for custom_id, line in by_id.items():
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200
        assert line["response"]["request_id"] == line["response"]["body"]["id"]
        assert _choices(line["response"]["body"]) == _choices(direct[custom_id])
        assert line["response"]["body"]["usage"] == direct[custom_id]["usage"]

    # Rerun with the same lines plus a bad line, an unknown url and a request the endpoint refuses.
    with source.open("a") as f:
        f.write("not json\n")
        f.write(json.dumps({"custom_id": "no-url", "method": "POST", "body": {}}) + "\n")
        f.write(_line("unknown", "/v1/nowhere", CHAT) + "\n")
        f.write(_line("refused", "/v1/completions", {**COMPLETION, "max_tokens": -1}) + "\n")
    assert _run(model_dir, source, output) == 0
    lines = [json.loads(text) for text in output.read_text().splitlines()]
    assert lines[:2] == first  # the answered lines are neither rerun nor rewritten
    added = lines[2:]
    assert len(added) == 4
    by_id = {line["custom_id"]: line for line in added}
    assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["response"] is None
    assert by_id["no-url"]["error"]["code"] == "invalid_request" and "url" in by_id["no-url"]["error"]["message"]
    assert by_id["unknown"]["error"]["code"] == "invalid_url"
    refused = by_id["refused"]
    assert refused["error"] is None and refused["response"]["status_code"] == 400
    assert "max_tokens" in refused["response"]["body"]["error"]["message"]

    # A third run reruns only the line without a custom_id (nothing can say it was answered).
    assert _run(model_dir, source, output) == 0
    lines = [json.loads(text) for text in output.read_text().splitlines()]
    assert len(lines) == 7 and lines[6]["custom_id"] is None and lines[6]["error"]["code"] == "invalid_json"
