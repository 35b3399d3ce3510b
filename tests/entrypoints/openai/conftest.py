"""The servers the OpenAI API tests run against (live `pagellm serve` subprocesses over a tiny random-weight Llama,
started with the root conftest's `start_server`), an OpenAI client and the tokenizer."""
from __future__ import annotations

import re
import resource
from pathlib import Path

import openai
import pytest

API_KEY = "test-key"
FUZZ_MAX_MODEL_LEN = 48
# /score and /rerank on a causal model wrap each pair in Qwen3-Reranker's prompt, 84 tokens before the texts.
SCORING_FUZZ_MAX_MODEL_LEN = 256
FUZZ_SERVER_HEADROOM_BYTES = 4 << 30



@pytest.fixture(scope="session")
def server(model_dir, start_server):
    """The shared server: API key required, 64 sequences per step."""
    yield from start_server(model_dir, "--api-key", API_KEY, "--max-num-seqs", "64")


@pytest.fixture(scope="module")
def limited_server(model_dir, start_server):
    """One sequence per step and room for one waiting request; no API key."""
    yield from start_server(model_dir, "--max-waiting-requests", "1", "--max-num-seqs", "1")


@pytest.fixture(scope="module")
def fuzz_server(model_dir, start_server):
    """A server of its own for each fuzz module (so that a crash they provoke cannot fail other modules): the API
    key, 16 sequences per step, and a context of 48 tokens (argparse keeps the last --max-model-len), so that any
    generation a fuzzed request asks for is short: SmolLM2's chat template alone is 30 tokens, which leaves 18.

    Its address space is capped a few GiB above its size once started: a request for a huge `n` makes an engine
    without bounds allocate per sample (n=100000 asked for 19.6 GB, n=2**31-1 grew a Python list until memory ran
    out), and on a shared test machine that must fail inside the server rather than exhaust the machine's memory."""
    for server in start_server(model_dir, "--api-key", API_KEY, "--max-model-len", str(FUZZ_MAX_MODEL_LEN),
                               "--max-num-seqs", "16"):
        _cap_address_space(server.process.pid, FUZZ_SERVER_HEADROOM_BYTES)
        yield server


@pytest.fixture(scope="module")
def scoring_fuzz_server(model_dir, start_server):
    """The fuzz server for /score and /rerank, whose prompts do not fit the 48-token context (so that the fuzzers
    reach their success path too): a context of SCORING_FUZZ_MAX_MODEL_LEN tokens; the same key, cap and limits."""
    for server in start_server(model_dir, "--api-key", API_KEY, "--max-model-len", str(SCORING_FUZZ_MAX_MODEL_LEN),
                               "--max-num-seqs", "16"):
        _cap_address_space(server.process.pid, FUZZ_SERVER_HEADROOM_BYTES)
        yield server


def _cap_address_space(pid: int, headroom_bytes: int) -> None:
    """Set process `pid`'s RLIMIT_AS to its current virtual size plus `headroom_bytes` (allocations beyond fail)."""
    status = Path(f"/proc/{pid}/status").read_text()
    vm_size = int(re.search(r"^VmSize:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024
    _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    limit = vm_size + headroom_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, hard))


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def guarded_server(model_dir, start_server):
    """API key, a 64 KiB body limit, 64 sequences per step, a KV pool of 256 blocks of 16 tokens (the last
    --kv-cache-memory wins) and at most 4 requests waiting for capacity."""
    yield from start_server(model_dir, "--api-key", API_KEY, "--max-request-body-bytes", "64KiB",
                            "--max-num-seqs", "64", "--kv-cache-memory", "2MiB", "--max-waiting-requests", "4")
