"""Many concurrent streams, a client that disconnects mid-stream, and /metrics: every request completes with the
same text as alone, and afterwards no request runs and no KV block is held."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

MODEL_NAME = "tiny"  # as served by the `server` fixture
NUM_STREAMS = 64
METRIC_NAMES = [
    "pagellm:num_requests_running", "pagellm:num_requests_waiting", "pagellm:kv_cache_usage_perc",
    "pagellm:prefix_cache_queries_total", "pagellm:prefix_cache_hits_total", "pagellm:num_preemptions_total",
    "pagellm:prompt_tokens_total", "pagellm:generation_tokens_total", "pagellm:request_success_total",
    "pagellm:time_to_first_token_seconds_count", "pagellm:inter_token_latency_seconds_count",
    "pagellm:e2e_request_latency_seconds_count", "pagellm:request_queue_time_seconds_count",
    "pagellm:kv_cache_token_efficiency", "pagellm:host_kv_cache_usage_perc", "pagellm:num_swapped_out_blocks_total",
    "pagellm:num_swapped_in_blocks_total", "pagellm:prefix_cache_preempted_queries_total",
    "pagellm:prefix_cache_preempted_hits_total",
]


def counter(metrics, name: str, **labels) -> float:
    return metrics[(name, tuple(sorted(labels.items())))]


def test_concurrent_streams_equal_non_streamed_greedy(server):
    prompts = [f"Request {i}: the numbers {i}, {i + 1} and" for i in range(NUM_STREAMS)]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)
    params = dict(model=MODEL_NAME, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})

    async def streamed(prompt: str) -> str:
        parts = []
        async for chunk in await client.completions.create(prompt=prompt, stream=True, **params):
            parts += [choice.text for choice in chunk.choices]
        return "".join(parts)

    async def whole(prompt: str) -> str:
        return (await client.completions.create(prompt=prompt, **params)).choices[0].text

    async def run() -> tuple[list[str], list[str]]:
        async with client:
            streams = await asyncio.gather(*(streamed(p) for p in prompts))
            return streams, await asyncio.gather(*(whole(p) for p in prompts))

    before = server.metrics()
    streams, expected = asyncio.run(run())
    assert streams == expected and all(streams)
    after = server.wait_until_idle()
    assert counter(after, "pagellm:num_requests_running") == 0
    assert counter(after, "pagellm:kv_cache_usage_perc") == 0
    assert counter(after, "pagellm:generation_tokens_total") - counter(before, "pagellm:generation_tokens_total") \
        == 2 * NUM_STREAMS * 12
    finished = "pagellm:request_success_total"
    assert counter(after, finished, finished_reason="length") - counter(before, finished, finished_reason="length") \
        == 2 * NUM_STREAMS
    assert counter(after, "pagellm:time_to_first_token_seconds_count") \
        - counter(before, "pagellm:time_to_first_token_seconds_count") == 2 * NUM_STREAMS


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 240, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {server.api_key}"}
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=30) as response:
        events = response.iter_lines()
        assert next(events).startswith("data: {")
        during = server.metrics()
        assert counter(during, "pagellm:num_requests_running") == 1
        assert counter(during, "pagellm:kv_cache_usage_perc") > 0
    after = server.wait_until_idle()  # the connection is closed: the request must be aborted, its blocks freed
    assert counter(after, "pagellm:num_requests_running") == 0
    assert counter(after, "pagellm:kv_cache_usage_perc") == 0
    finished = "pagellm:request_success_total"
    assert counter(after, finished, finished_reason="abort") - counter(before, finished, finished_reason="abort") == 1
    # Far fewer than the 240 tokens asked for were generated.
    assert counter(after, "pagellm:generation_tokens_total") - counter(before, "pagellm:generation_tokens_total") < 200


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 240, "ignore_eos": True}
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.1),
                   headers={"Authorization": f"Bearer {server.api_key}"})
    after = server.wait_until_idle()
    assert counter(after, "pagellm:kv_cache_usage_perc") == 0
    finished = "pagellm:request_success_total"
    assert counter(after, finished, finished_reason="abort") - counter(before, finished, finished_reason="abort") == 1
    assert counter(after, finished, finished_reason="length") == counter(before, finished, finished_reason="length")


def test_metrics_names_and_counters(server, client, tokenizer):
    before = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt="Count my tokens", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.metrics()
    names = {name for name, _ in after}
    assert set(METRIC_NAMES) <= names
    num_prompt = len(tokenizer.encode("Count my tokens"))
    for name, delta in (("pagellm:prompt_tokens_total", num_prompt), ("pagellm:generation_tokens_total", 5),
                        ("pagellm:prefix_cache_queries_total", num_prompt), ("pagellm:prefix_cache_hits_total", 0),
                        ("pagellm:e2e_request_latency_seconds_count", 1),
                        ("pagellm:inter_token_latency_seconds_count", 4)):
        assert counter(after, name) - counter(before, name) == delta, name
    text = httpx.get(f"{server.url}/metrics").text
    assert 'model_name="tiny"' in text and "Prefix cache hits" in text
    [cache_info] = [dict(labels) for name, labels in after if name == "pagellm:cache_config_info"]
    assert cache_info["kv_dtype"] == "float32" and cache_info["block_size"] == "16"
