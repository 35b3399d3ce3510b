"""`pagellm serve --data-parallel-size 2`: two engine replicas in processes of their own behind one server. Outputs
equal the single-engine server's, the load spreads over both, a shared prompt prefix goes back to the replica that
holds it, /metrics has a series per replica, and a replica killed with SIGKILL turns /health to 503 with no process
left behind once the server stops."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

MODEL_NAME = "tiny"
PARAMS = dict(model=MODEL_NAME, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def dp_server(model_dir, start_server):
    """Two replicas (the last test of this module kills one)."""
    yield from start_server(model_dir, "--data-parallel-size", "2", "--max-num-seqs", "16")


def children(pid: int) -> list[int]:
    return [int(p) for task in Path(f"/proc/{pid}/task").iterdir()
            for p in (task / "children").read_text().split()]


def per_engine(metrics, name: str, **labels) -> list[float]:
    return [metrics[(name, tuple(sorted({"engine": str(e), **labels}.items())))] for e in range(2)]


def complete(server, prompts: list[list[int]]) -> list[str]:
    """Greedy completions of token-id prompts, sent all at once."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "none", max_retries=0,
                                timeout=120)

    async def one(prompt: list[int]) -> str:
        return (await client.completions.create(prompt=prompt, **PARAMS)).choices[0].text

    async def run() -> list[str]:
        async with client:
            return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


def test_outputs_equal_one_engine_and_the_load_spreads(dp_server, server, make_token_prompts):
    prompts = [p["prompt_token_ids"] for p in make_token_prompts([40, 7, 33, 18, 60, 25, 9, 51], seed=3)]
    before = dp_server.metrics(per_engine=True)
    assert complete(dp_server, prompts) == complete(server, prompts)
    dp_server.wait_until_idle()
    after = dp_server.metrics(per_engine=True)
    generated = [a - b for a, b in zip(per_engine(after, "pagellm:generation_tokens_total"),
                                       per_engine(before, "pagellm:generation_tokens_total"))]
    assert sum(generated) == len(prompts) * PARAMS["max_tokens"]
    assert all(tokens > 0 for tokens in generated), generated
    assert per_engine(after, "pagellm:num_requests_running") == [0, 0]
    assert per_engine(after, "pagellm:kv_cache_used_blocks") == [0, 0]
    assert all(blocks > 0 for blocks in per_engine(after, "pagellm:kv_cache_num_blocks"))


def test_a_shared_prefix_is_served_where_it_is_cached(dp_server, make_token_prompts):
    (prefix,) = [p["prompt_token_ids"] for p in make_token_prompts([64], seed=11)]  # four full blocks
    client = httpx.Client(base_url=dp_server.url, timeout=60)
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    # Keep replica 0 busy with a long request, so that the first prefixed request goes to replica 1.
    busy_request = {**body, "prompt": [5] * 8, "max_tokens": 200, "stream": True}
    with client.stream("POST", "/v1/completions", json=busy_request) as busy:
        next(busy.iter_lines())
        assert client.post("/v1/completions", json={**body, "prompt": prefix + [1, 2]}).status_code == 200
    dp_server.wait_until_idle()
    before = dp_server.metrics(per_engine=True)
    # Both replicas are idle now; without affinity these would go to replica 0 and miss.
    for suffix in ([3, 4, 5], [6], [7, 8]):
        assert client.post("/v1/completions", json={**body, "prompt": prefix + suffix}).status_code == 200
    after = dp_server.metrics(per_engine=True)
    hits = [a - b for a, b in zip(per_engine(after, "pagellm:prefix_cache_hits_total"),
                                  per_engine(before, "pagellm:prefix_cache_hits_total"))]
    assert hits == [0, 3 * 64]


def test_each_replica_shows_its_own_engine_state(dp_server):
    client = httpx.Client(base_url=dp_server.url, timeout=60)
    states = [client.get("/v1/engine/state", params={"engine": e}).json()["engine"] for e in range(2)]
    metrics = dp_server.metrics(per_engine=True)
    assert [state["device"]["num_blocks"] for state in states] == per_engine(metrics, "pagellm:kv_cache_num_blocks")
    response = client.get("/v1/engine/state", params={"engine": 2})
    assert response.status_code == 400 and "--data-parallel-size" in response.json()["error"]["message"]


def test_a_killed_replica_turns_health_503_and_nothing_is_left_behind(dp_server):
    replicas = [pid for pid in children(dp_server.process.pid)
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(replicas) == 2
    descendants = replicas + [pid for replica in replicas for pid in children(replica)]
    client = httpx.Client(base_url=dp_server.url, timeout=60)
    with client.stream("POST", "/v1/completions",
                       json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 240, "ignore_eos": True,
                             "stream": True}) as stream:
        lines = stream.iter_lines()
        next(lines)
        running = per_engine(dp_server.metrics(per_engine=True), "pagellm:num_requests_running")
        victim = running.index(1)  # the replica that runs this request (replica i is the i-th child started)
        os.kill(replicas[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        while client.get("/health").status_code == 200:
            assert time.monotonic() - killed_at < 5, "/health still 200 five seconds after a replica died"
            time.sleep(0.05)
        rest = "\n".join(lines)  # the stream ends with an error event
    assert f"Engine replica {victim} exited unexpectedly" in rest
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    assert response.status_code == 503 and f"replica {victim}" in response.json()["error"]["message"]
    dp_server.stop()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and b"Z" not in _state(pid) for pid in descendants):
        assert time.monotonic() < deadline, "replica processes outlived the server"
        time.sleep(0.1)


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().split(b") ")[1][:1]
    except (FileNotFoundError, IndexError):
        return b"Z"
