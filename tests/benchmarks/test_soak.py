"""`pagellm bench soak`: the plan a seed gives, the request bodies, the outcome and report maths, and a 30 s soak of
a live `pagellm serve` that must end with no 5xx, no unexpected outcome and an idle, healthy server."""
from __future__ import annotations

import argparse
import json
import socket
from collections import Counter

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from test_serve_bench import running  # a uvicorn thread on a free port (tests/benchmarks is on sys.path)

from pagellm.benchmarks import soak, soak_report
from pagellm.entrypoints.cli import main

SOAK_SECONDS = 30
API_KEY = "soak-key"
BUDGET, PROMPT_LENS = 200, [1, 40, 120, 199]
MIX = soak.TrafficMix(bad_fraction=0.2, disconnect_fraction=0.3, max_output_len=50)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak.add_cli_args(parser)
    return parser.parse_args(list(argv))


def plans(seed: int, count: int = 2000) -> list[soak.PlannedRequest]:
    return [soak.plan_request(seed, i, PROMPT_LENS, BUDGET, MIX) for i in range(count)]


# ---------------------------------------------------------------- the plan


def test_the_plan_depends_only_on_the_seed_and_follows_the_mix():
    planned = plans(seed=3)
    assert planned == plans(seed=3) and planned != plans(seed=4)
    assert soak.plan_request(3, 1234, PROMPT_LENS, BUDGET, MIX) == planned[1234]  # no state carried between requests
    bad = [p for p in planned if p.kind in soak.BAD_REQUESTS]
    abandoned = [p for p in planned if p.abandon_after_chunks is not None]
    assert len(bad) / len(planned) == pytest.approx(MIX.bad_fraction, abs=0.03)
    assert len(abandoned) / len(planned) == pytest.approx(MIX.disconnect_fraction, abs=0.03)
    assert {p.kind for p in bad} == set(soak.BAD_REQUESTS)
    assert not any(p.kind in soak.BAD_REQUESTS or p.kind == "tokenize" for p in abandoned)
    kinds = Counter(p.kind for p in planned)
    assert kinds["completion"] > 300 and kinds["chat"] > 300 and 0 < kinds["tokenize"] < 100


def test_good_requests_fit_the_budget_and_vary_every_dimension():
    good = [p for p in plans(seed=0) if p.kind in ("completion", "chat")]
    assert all(1 <= p.max_tokens <= MIX.max_output_len and PROMPT_LENS[p.prompt_index] + p.max_tokens <= BUDGET
               for p in good)
    assert {p.n for p in good} == {1, 2, 3} and {p.stream for p in good} == {True, False}
    assert {p.prompt_index for p in good} == set(range(len(PROMPT_LENS)))
    assert {p.sampling.get("temperature") for p in good} == {0.0, 0.8, 1.0}
    assert len({p.sampling["seed"] for p in good if "seed" in p.sampling}) > 50
    abandoned = [p for p in good if p.abandon_after_chunks is not None]
    assert all(p.abandon_after_chunks == 0 for p in abandoned if not p.stream)  # no chunks: before the headers
    assert {p.abandon_after_chunks for p in abandoned if p.stream} == set(range(soak.MAX_ABANDON_CHUNKS + 1))
    low, high = soak.ABANDON_DELAY_RANGE_S
    assert all(low <= p.abandon_delay_s <= high for p in abandoned)


# ---------------------------------------------------------------- request bodies


def test_request_bodies_and_expected_statuses():
    target = soak.Target("http://x", {}, "m", max_model_len=64, chat_overhead=0, prompts=["Hello there"])
    chat = soak.PlannedRequest("chat", stream=True, max_tokens=5, n=2, sampling={"temperature": 0.0})
    path, body, status = soak.build_request(chat, target)
    assert (path, status) == ("/v1/chat/completions", 200)
    assert body == {"model": "m", "n": 2, "stream": True, "temperature": 0.0, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "Hello there"}], "max_completion_tokens": 5}
    path, body, _ = soak.build_request(soak.PlannedRequest("completion", max_tokens=3), target)
    assert path == "/v1/completions" and body["prompt"] == "Hello there" and body["max_tokens"] == 3
    assert "stream_options" not in body
    assert soak.build_request(soak.PlannedRequest("tokenize"), target)[:2] == ("/tokenize",
                                                                               {"model": "m", "prompt": "Hello there"})
    for kind, (_, expected) in soak.BAD_REQUESTS.items():
        path, body, status = soak.build_request(soak.PlannedRequest(kind, stream=True), target)
        assert status == expected and 400 <= status < 500 and path.startswith("/v1/")
        if isinstance(body, dict):
            assert body["stream"] is True
    _, malformed, _ = soak.build_request(soak.PlannedRequest("malformed JSON"), target)
    with pytest.raises(json.JSONDecodeError):
        json.loads(malformed)
    _, too_long, _ = soak.build_request(soak.PlannedRequest("prompt over max_model_len"), target)
    assert len(too_long["prompt"].split()) >= 4 * target.max_model_len


# ---------------------------------------------------------------- outcomes and the report


def test_outcomes_that_are_unexpected():
    outcome = soak_report.Outcome
    assert not outcome("chat", 200, status=200, served=True).unexpected
    assert outcome("chat", 200, status=200).unexpected  # 200 but not read to the end (no [DONE], a choice unfinished)
    assert outcome("chat", 200, status=500).unexpected and outcome("chat", 200, error="ReadTimeout: ...").unexpected
    assert not outcome("chat", 200, abandoned=True).unexpected
    assert not outcome("chat", 200, status=200, abandoned=True).unexpected
    assert outcome("chat", 200, status=503, abandoned=True).unexpected
    assert not outcome("n 0", 400, status=400).unexpected
    assert outcome("n 0", 400, status=200).unexpected and outcome("unknown model", 404, status=400).unexpected


IDLE = soak_report.ServerState(running=0, waiting=0, used_blocks=0, rss_bytes=100 * soak_report.MIB)


def test_report_counts_and_exit_status():
    outcome = soak_report.Outcome
    outcomes = [outcome("completion", 200, 200, served=True), outcome("chat", 200, 200, served=True),
                outcome("tokenize", 200, 200, served=True), outcome("chat", 200, None, abandoned=True),
                outcome("chat", 200, 200, abandoned=True), outcome("n 0", 400, 400), outcome("unknown model", 404, 404),
                outcome("top_p 2", 400, 200, body='{"choices": []}')]
    end = soak_report.ServerState(running=0, waiting=0, used_blocks=0, rss_bytes=150.5 * soak_report.MIB)
    report = soak_report.summarize(outcomes, 60.2, IDLE, end, 200)
    assert (report.requests_sent, report.served, report.abandoned) == (8, 3, 2)
    assert (report.bad_sent, report.bad_rejected_as_expected) == (3, 2)
    assert report.errors_by_status == {"400": 1, "404": 1}
    assert report.unexpected == 1 and report.unexpected_samples == [
        {"kind": "top_p 2", "expected": 400, "status": 200, "error": "", "body": '{"choices": []}'}]
    assert (report.rss_start_mib, report.rss_end_mib) == (100.0, 150.5)
    assert report.problems() == ["1 unexpected outcomes"] and report.exit_status == 1
    assert "Unexpected outcomes:" in report.format() and "FAILED: 1 unexpected outcomes" in report.format()

    clean = soak_report.summarize(outcomes[:-1], 60.2, IDLE, end, 200)
    assert clean.problems() == [] and clean.exit_status == 0 and clean.format().endswith("PASSED")


def test_a_5xx_a_leak_a_busy_or_dead_server_each_fail_the_soak():
    busy = soak_report.ServerState(running=1, waiting=2, used_blocks=7, rss_bytes=0)
    report = soak_report.summarize([soak_report.Outcome("chat", 200, 500, body="boom")], 1.0, IDLE, busy, 503)
    assert report.errors_by_status == {"500": 1}
    assert report.problems() == ["1 responses with a 5xx status", "1 unexpected outcomes",
                                 "KV blocks in use after the drain: 7", "requests after the drain: 1 running, "
                                 "2 waiting", "/health answered 503 at the end"]
    gone = soak_report.summarize([], 1.0, IDLE, None, None)  # /metrics and /health stopped answering
    assert gone.kv_blocks_used_after_drain is None and gone.rss_end_mib is None and gone.exit_status == 1


def test_server_state_from_metrics_text():
    text = "\n".join(["# TYPE pagellm:num_requests_running gauge", 'pagellm:num_requests_running{model_name="m"} 2.0',
                      "# TYPE pagellm:num_requests_waiting gauge", 'pagellm:num_requests_waiting{model_name="m"} 1.0',
                      "# TYPE pagellm:kv_cache_used_blocks gauge", 'pagellm:kv_cache_used_blocks{model_name="m"} 9.0',
                      "# TYPE process_resident_memory_bytes gauge", "process_resident_memory_bytes 1.048576e+07", ""])
    expected = soak_report.ServerState(running=2, waiting=1, used_blocks=9, rss_bytes=10 * soak_report.MIB)
    assert soak_report.parse_server_state(text) == expected and not expected.idle
    with pytest.raises(ValueError, match="pagellm:kv_cache_used_blocks"):
        soak_report.parse_server_state(text.replace("kv_cache_used_blocks", "kv_cache_other"))


# ---------------------------------------------------------------- CLI errors


def test_unreachable_server_is_one_line_and_exit_1(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["bench", "soak", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot reach the server at http://127.0.0.1:{port}") and "\n" not in err


def test_option_values_are_checked():
    with pytest.raises(ValueError, match="sum <= 1"):
        soak.run(parse("--bad-fraction", "0.6", "--disconnect-fraction", "0.5"))
    with pytest.raises(ValueError, match="--concurrency"):
        soak.run(parse("--concurrency", "0"))


# ---------------------------------------------------------------- a broken server


class BrokenServer:
    """Answers 500 to every generation and every bad request, and its /metrics shows 3 KV blocks held forever."""

    def __init__(self) -> None:
        self.app = FastAPI()  # `running` serves `.app`
        self.app.get("/v1/models")(lambda: {"data": [{"id": "fake", "max_model_len": 128}]})
        self.app.post("/tokenize")(lambda: {"count": 2, "tokens": [5, 6], "max_model_len": 128})
        self.app.get("/metrics")(lambda: PlainTextResponse(
            'pagellm:num_requests_running{model_name="fake"} 0\npagellm:num_requests_waiting{model_name="fake"} 0\n'
            'pagellm:kv_cache_used_blocks{model_name="fake"} 3\nprocess_resident_memory_bytes 1e8\n'))
        self.app.get("/health")(lambda: None)
        for path in ("/v1/completions", "/v1/chat/completions"):
            self.app.post(path)(lambda: JSONResponse({"error": {"message": "boom", "code": 500}}, status_code=500))


def test_a_broken_server_fails_the_soak_with_its_5xx_and_leak_reported(tiny_model_factory, tmp_path, capsys):
    report_path = tmp_path / "soak.json"
    with running(BrokenServer()) as url:
        exit_status = main(["bench", "soak", "--base-url", url, "--tokenizer", str(tiny_model_factory("llama")),
                            "--duration", "1", "--concurrency", "2", "--drain-timeout", "0.5", "--bad-fraction",
                            "0.3", "--disconnect-fraction", "0", "--output-json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert exit_status == 1
    tokenize = report["served"]  # /tokenize is the one thing that works
    assert report["errors_by_status"] == {"500": report["requests_sent"] - tokenize} and tokenize < 10
    assert report["bad_sent"] > 0 and report["bad_rejected_as_expected"] == 0
    assert report["unexpected"] == report["requests_sent"] - tokenize
    assert {sample["status"] for sample in report["unexpected_samples"]} == {500}
    assert all("boom" in sample["body"] for sample in report["unexpected_samples"])
    assert report["kv_blocks_used_after_drain"] == 3 and report["health_status"] == 200
    assert report["problems"][0].endswith("responses with a 5xx status")
    assert "KV blocks in use after the drain: 3" in report["problems"]
    assert "FAILED" in capsys.readouterr().out


# ---------------------------------------------------------------- a live server


@pytest.fixture(scope="module")
def soak_server(tiny_model_factory, start_server):
    yield from start_server(tiny_model_factory("llama"), "--api-key", API_KEY, "--max-model-len", "256",
                            "--kv-cache-memory", "4MiB", "--max-num-seqs", "16")


def test_a_missing_api_key_is_a_clear_error_not_a_soak_of_401s(soak_server, capsys):
    assert main(["bench", "soak", "--base-url", soak_server.url]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: GET {soak_server.url}/v1/models answered 401") and "\n" not in err


def test_thirty_second_soak_of_a_live_server(soak_server, tiny_model_factory, tmp_path, capsys):
    report_path = tmp_path / "soak.json"
    exit_status = soak.run(parse("--base-url", soak_server.url, "--api-key", API_KEY, "--duration", str(SOAK_SECONDS),
                                 "--tokenizer", str(tiny_model_factory("llama")), "--bad-fraction", "0.1",
                                 "--disconnect-fraction", "0.15", "--max-output-len", "32", "--seed", "1",
                                 "--json", str(report_path)))
    printed = capsys.readouterr().out
    print(printed)  # captured again: pytest shows the report when the test fails (or with -rP)
    report = json.loads(report_path.read_text())
    assert exit_status == 0, report["problems"]
    assert report["duration_s"] >= SOAK_SECONDS and report["served"] > 0
    assert report["abandoned"] > 0 and report["bad_sent"] > 0
    assert report["bad_rejected_as_expected"] == report["bad_sent"]
    assert report["served"] + report["abandoned"] + report["bad_sent"] == report["requests_sent"]
    assert not any(status.startswith("5") for status in report["errors_by_status"])
    assert report["unexpected"] == 0 and report["unexpected_samples"] == [] and report["problems"] == []
    assert (report["kv_blocks_used_after_drain"], report["running_after_drain"], report["waiting_after_drain"]) == (
        0, 0, 0)
    assert report["rss_start_mib"] > 10 and report["rss_halfway_mib"] > 10 and report["rss_end_mib"] > 10
    assert report["health_status"] == 200
    assert "Soak Test Result" in printed and printed.rstrip().endswith("PASSED")
    # The soak itself must leave the server as it found it: what /metrics says after the run, not just the report.
    metrics = soak_report.parse_server_state(httpx.get(f"{soak_server.url}/metrics", timeout=10).text)
    assert metrics.idle
