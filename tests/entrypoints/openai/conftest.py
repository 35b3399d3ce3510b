"""Live `pagellm serve` subprocesses on 127.0.0.1 (a free port each) over a tiny random-weight Llama, and helpers
to read their /metrics."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
MODEL_NAME = "tiny"
OTHER_MODEL_NAME = "tiny-alias"
MAX_MODEL_LEN = 256
SERVER_START_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """`python -m pagellm.entrypoints.cli serve MODEL ...` in a subprocess, ready once /health answers 200."""

    model_name = MODEL_NAME
    alias = OTHER_MODEL_NAME
    api_key = API_KEY

    def __init__(self, model_dir: Path, extra_args: list[str], log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", MODEL_NAME, OTHER_MODEL_NAME,
                "--max-model-len", str(MAX_MODEL_LEN),
                "--kv-cache-memory", "4MiB", "--uvicorn-log-level", "warning", *extra_args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PAGELLM_API_KEY="")
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the server did not start in {SERVER_START_TIMEOUT_S} s:\n{self.log()}")

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics as {(sample name, sorted labels other than model_name): value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))):
                sample.value for family in text_string_to_metric_families(text) for sample in family.samples}

    def wait_until_idle(self, timeout_s: float = 15.0) -> dict[tuple[str, tuple], float]:
        """Poll /metrics until no request runs or waits and no KV block is held; returns the last reading."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.metrics()
            idle = (metrics[("pagellm:num_requests_running", ())] == 0
                    and metrics[("pagellm:num_requests_waiting", ())] == 0
                    and metrics[("pagellm:kv_cache_usage_perc", ())] == 0)
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(model_dir: Path, tmp_path_factory, *extra_args: str):
    server = RemoteServer(model_dir, list(extra_args), tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    """The shared server: API key required, 64 sequences per step."""
    yield from start_server(model_dir, tmp_path_factory, "--api-key", API_KEY, "--max-num-seqs", "64")


@pytest.fixture(scope="module")
def limited_server(model_dir, tmp_path_factory):
    """One sequence per step and room for one waiting request; no API key."""
    yield from start_server(model_dir, tmp_path_factory, "--max-waiting-requests", "1", "--max-num-seqs", "1")


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
