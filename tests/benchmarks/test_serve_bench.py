"""`pagellm bench serve`: the metric maths, the arrival process, and whole runs against a fake streaming server."""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagellm.benchmarks import serve as bench
from pagellm.benchmarks import serve_load, serve_metrics, serve_prompts

FIRST_DELAY, GAP, PROMPT_TOKENS = 0.1, 0.02, 7


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    return parser.parse_args(["--disable-tqdm", *argv])


# ---------------------------------------------------------------- metrics


def test_compute_metrics_matches_numpy():
    R = serve_load.RequestResult
    results = [R(True, 10, 4, ttft=0.10, itl=[0.02, 0.03, 0.025], latency=0.175),
               R(True, 20, 1, ttft=0.30, itl=[], latency=0.30),
               R(True, 15, 6, ttft=0.05, itl=[0.01] * 5, latency=0.12),
               R(False, 12, 0, error="HTTP 400: nope")]
    duration = 2.0
    metrics = serve_metrics.compute_metrics(results, duration, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99])
    ok = results[:3]
    ttft = np.array([0.10, 0.30, 0.05]) * 1000
    tpot = np.array([(0.175 - 0.10) / 3, (0.12 - 0.05) / 5]) * 1000  # the 1-token request has no TPOT
    itl = np.array([0.02, 0.03, 0.025] + [0.01] * 5) * 1000
    e2el = np.array([0.175, 0.30, 0.12]) * 1000
    assert metrics["completed"] == 3 and metrics["failed"] == 1 and metrics["errors"] == ["HTTP 400: nope"]
    assert metrics["total_input_tokens"] == 45 and metrics["total_output_tokens"] == 11
    assert metrics["request_throughput"] == pytest.approx(3 / duration)
    assert metrics["output_throughput"] == pytest.approx(11 / duration)
    assert metrics["total_token_throughput"] == pytest.approx(56 / duration)
    assert len(ok) == 3
    for name, values in {"ttft": ttft, "tpot": tpot, "itl": itl, "e2el": e2el}.items():
        assert metrics[f"mean_{name}_ms"] == pytest.approx(values.mean())
        assert metrics[f"median_{name}_ms"] == pytest.approx(np.median(values))
        assert metrics[f"std_{name}_ms"] == pytest.approx(values.std())
        for p in (50, 90, 99):
            assert metrics[f"p{p}_{name}_ms"] == pytest.approx(np.percentile(values, p))
    report = serve_metrics.format_report(metrics, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99], None)
    assert "Successful requests:" in report and "P99 ITL (ms):" in report and "Mean TPOT (ms):" in report


def test_compute_metrics_without_successes_reports_zeros():
    metrics = serve_metrics.compute_metrics([serve_load.RequestResult(error="boom")], 1.0)
    assert metrics["completed"] == 0 and metrics["failed"] == 1
    assert metrics["mean_ttft_ms"] == 0 and metrics["p99_e2el_ms"] == 0


# ---------------------------------------------------------------- arrivals


def test_poisson_arrivals_have_mean_gap_one_over_rate_and_burstiness_sets_the_variance():
    rate, n = 10.0, 20000
    gaps = {k: np.diff(serve_load.arrival_offsets(n, rate, k, seed=0)) for k in (0.25, 1.0, 4.0)}
    for k, g in gaps.items():
        assert g.mean() == pytest.approx(1 / rate, rel=0.05)
        # Gamma(shape k, scale 1 / (rate k)) has variance 1 / (rate^2 k); k = 1 is exponential (Poisson).
        assert g.var() == pytest.approx(1 / (rate**2 * k), rel=0.1)
    assert gaps[0.25].var() > gaps[1.0].var() > gaps[4.0].var()
    assert serve_load.arrival_offsets(5, rate, 1.0, seed=0)[0] == 0.0
    np.testing.assert_array_equal(serve_load.arrival_offsets(50, rate, 1.0, 3),
                                  serve_load.arrival_offsets(50, rate, 1.0, 3))
    assert not serve_load.arrival_offsets(4, float("inf"), 1.0, 0).any()


# ---------------------------------------------------------------- end to end against a fake server


class FakeServer:
    """Streams `max_tokens` one-token chunks: FIRST_DELAY before the first, GAP between the others."""

    def __init__(self, fail_every: int = 0, usage: bool = True):
        self.fail_every, self.usage = fail_every, usage
        self.requests = self.in_flight = self.max_in_flight = self.tokens_sent = 0
        self.bodies: list[dict] = []
        self.app = FastAPI()
        self.app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        self.app.post("/v1/completions")(self.handle)
        self.app.post("/v1/chat/completions")(self.handle)

    async def handle(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        self.requests += 1
        if self.fail_every and self.requests % self.fail_every == 0:
            return JSONResponse({"error": {"message": "prompt rejected by the fake server"}}, status_code=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        chat = "messages" in body
        n = body["max_completion_tokens" if chat else "max_tokens"]

        async def stream():
            try:
                await asyncio.sleep(FIRST_DELAY)
                for i in range(n):
                    if i:
                        await asyncio.sleep(GAP)
                    choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
                    self.tokens_sent += 1
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if self.usage:
                    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": n + PROMPT_TOKENS}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")


@contextmanager
def running(server: FakeServer):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(5)
        sock.close()


@pytest.fixture(scope="module")
def tokenizer():
    return serve_prompts.load_tokenizer(None)  # the default model's tokenizer, loaded once (cached) for every run below


def test_random_prompts_have_the_asked_lengths_and_follow_the_seed(tokenizer):
    prompts = serve_prompts.random_prompts(tokenizer, 20, 32, 8, 0.5, seed=0)
    assert all(16 <= p.prompt_len <= 48 and 4 <= p.output_len <= 12 for p in prompts)
    assert len({p.output_len for p in prompts}) > 1  # the range ratio spreads the lengths
    assert all(len(tokenizer.encode(p.prompt, add_special_tokens=False)) <= p.prompt_len + 2 for p in prompts)
    assert prompts == serve_prompts.random_prompts(tokenizer, 20, 32, 8, 0.5, seed=0)


def test_completions_run_measures_streams_and_respects_max_concurrency(tokenizer, tmp_path, capsys):
    server = FakeServer()
    result_file = tmp_path / "result.json"
    with running(server) as url:
        metrics = bench.run(parse("--base-url", url, "--num-prompts", "6", "--random-input-len", "16",
                                  "--random-output-len", "5", "--max-concurrency", "2", "--metric-percentiles",
                                  "0,50,99", "--save-result", str(result_file)))
    assert metrics["completed"] == 6 and metrics["failed"] == 0
    assert metrics["total_output_tokens"] == server.tokens_sent == 30
    assert metrics["total_input_tokens"] == 6 * PROMPT_TOKENS  # the server's usage wins over the local count
    assert server.max_in_flight == 2
    assert metrics["p0_ttft_ms"] >= FIRST_DELAY * 1000  # p0 is the minimum
    assert metrics["p0_e2el_ms"] >= (FIRST_DELAY + 4 * GAP) * 1000
    assert metrics["median_itl_ms"] >= GAP * 1000 * 0.5 and metrics["median_tpot_ms"] >= GAP * 1000 * 0.5
    assert metrics["request_throughput"] == pytest.approx(6 / metrics["duration"])
    body = server.bodies[0]
    assert body["model"] == "fake-model" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and isinstance(body["prompt"], str)
    saved = json.loads(result_file.read_text())
    assert saved["completed"] == 6 and saved["request_rate"] == "inf"
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_http_errors_are_counted_with_their_text(tokenizer, capsys):
    server = FakeServer(fail_every=3)
    with running(server) as url:
        metrics = bench.run(parse("--base-url", url, "--num-prompts", "6", "--random-input-len", "8",
                                  "--random-output-len", "2", "--model", "m"))
    assert metrics["completed"] == 4 and metrics["failed"] == 2
    assert all(e.startswith("HTTP 400") and "prompt rejected" in e for e in metrics["errors"])
    out = capsys.readouterr().out
    assert "2 requests failed" in out and "prompt rejected by the fake server" in out


def test_chat_backend_with_prompt_file_and_no_usage_counts_chunks(tokenizer, tmp_path):
    server = FakeServer(usage=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "What is paged attention?"}\n')
    with running(server) as url:
        host, port = url.removeprefix("http://").split(":")
        metrics = bench.run(parse("--host", host, "--port", port, "--backend", "openai-chat", "--dataset-path",
                                  str(prompts), "--num-prompts", "3", "--random-output-len", "3", "--no-ignore-eos",
                                  "--request-rate", "50", "--seed", "1"))
    assert metrics["completed"] == 3 and metrics["total_output_tokens"] == server.tokens_sent == 9
    assert [b["messages"][0]["content"] for b in server.bodies] == ["Hello there", "What is paged attention?",
                                                                     "Hello there"]
    assert all("ignore_eos" not in b and b["max_completion_tokens"] == 3 for b in server.bodies)


def test_unreachable_server_gives_one_clear_line(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        bench.run(parse("--port", str(port)))

    from pagellm.entrypoints.cli import main

    assert main(["bench", "serve", "--port", str(port), "--model", "m"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot reach the server at http://127.0.0.1:") and f":{port}" in err
    assert "\n" not in err and "Traceback" not in err
