"""A server with one sequence per step and room for one waiting request: a burst of requests gets 503 with
Retry-After for the overflow and serves the rest; SIGTERM with a stream in flight ends the stream and exits 0."""
from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

LONG = {"prompt": "Write a long essay.", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def test_full_queue_is_503_with_retry_after(limited_server):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=limited_server.url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=LONG) for _ in range(6)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 503}, statuses
    for response in responses:
        if response.status_code == 503:
            assert int(response.headers["Retry-After"]) >= 1
            error = response.json()["error"]
            assert error["code"] == 503 and "waiting" in error["message"]
        else:
            assert response.json()["usage"]["completion_tokens"] == 200
    good = httpx.post(f"{limited_server.url}/v1/completions", json=dict(LONG, max_tokens=3), timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
    assert limited_server.wait_until_idle()[("pagellm:num_requests_running", ())] == 0


def test_sigterm_with_a_stream_in_flight_exits_0(limited_server):
    with httpx.stream("POST", f"{limited_server.url}/v1/completions", json=dict(LONG, stream=True),
                      timeout=30) as response:
        events = response.iter_lines()
        assert next(events).startswith("data: {")
        limited_server.process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        rest = [line for line in events if line]
    assert rest[-1] == "data: [DONE]"
    assert '"code": 503' in rest[-2] and "shutting down" in rest[-2]  # the stream ends with an error event
    assert limited_server.process.wait(timeout=10) == 0
    assert time.monotonic() - start < 10
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{limited_server.url}/health", timeout=2)
