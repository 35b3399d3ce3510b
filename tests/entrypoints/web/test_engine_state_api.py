"""The pages and the dashboard's API over plain HTTP: the pages and their files load without the key while the state
endpoints need it; snapshots taken while a load runs are self-consistent (block states against the requests'
block tables); the stream sends the whole history first and only newer points after, at the asked interval."""
from __future__ import annotations

import json
import math
import time
from collections import Counter

import httpx
import pytest


def test_pages_are_open_and_the_state_needs_the_key(web_server):
    for path in ("/", "/dashboard"):
        page = httpx.get(web_server.url + path, timeout=30)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
    for name in ("chat.js", "dashboard.js", "markdown.js", "api.js", "style.css"):
        assert httpx.get(f"{web_server.url}/static/{name}", timeout=30).status_code == 200
    config = httpx.get(f"{web_server.url}/web/config", timeout=30).json()
    assert config["api_key_required"] is True
    assert config["sampling_defaults"] == {"temperature": 1.0, "top_p": 1.0, "max_tokens": None, "seed": None}
    for path in ("/v1/engine/state", "/v1/engine/state/stream"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.get(web_server.url + path, headers=headers, timeout=30)
            assert response.status_code == 401 and response.json()["error"]["code"] == 401


def check_snapshot(state: dict) -> Counter:
    """Asserts a snapshot's numbers agree with each other; returns the block-state counts."""
    device = state["device"]
    counts = device["counts"]
    assert counts["free"] + counts["cached"] + counts["used"] + counts["shared"] == device["num_blocks"]
    assert len(device["states"]) <= device["num_blocks"]
    assert Counter(device["states"]) + Counter({".": device["num_blocks"] - len(device["states"])}) == Counter(
        {".": counts["free"], "c": counts["cached"], "u": counts["used"], "s": counts["shared"]})
    listed = state["running"] + state["waiting"]
    assert len(state["running"]) == state["num_running"] and len(state["waiting"]) == state["num_waiting"]
    holders = Counter(block for request in listed for block in request["blocks"])
    for block, code in enumerate(device["states"]):
        assert holders[block] == {".": 0, "c": 0, "u": 1}.get(code, holders[block]), (block, code)
        assert code != "s" or holders[block] > 1, block
    assert all(block < len(device["states"]) for block in holders)
    for request in state["running"]:  # between steps a table holds exactly the computed tokens' blocks
        assert len(request["blocks"]) == math.ceil(request["num_computed_tokens"] / state["block_size"]), request
        assert request["num_output_tokens"] <= request["max_tokens"]
    return Counter(device["states"])


def test_snapshots_under_load_agree_with_the_block_tables(api, run_load):
    load = run_load(num_requests=6, max_tokens=32)
    seen = Counter()
    snapshots = 0
    while not load.done():
        response = api.get("/v1/engine/state")
        assert response.status_code == 200
        state = response.json()["engine"]
        seen.update(check_snapshot(state))
        snapshots += 1
        time.sleep(0.1)
    load.wait()
    assert snapshots >= 3 and seen["u"] and seen["s"], (snapshots, seen)  # n = 2 and the shared prompt share blocks
    deadline = time.monotonic() + 10
    while True:  # the finished requests' blocks go back to free or cached
        state = api.get("/v1/engine/state").json()["engine"]
        if not state["running"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    check_snapshot(state)
    assert state["running"] == [] and state["waiting"] == []
    assert set(state["device"]["states"]) <= {".", "c"} and state["device"]["counts"]["cached"] > 0


def read_events(response: httpx.Response, count: int) -> list[dict]:
    events, buffer = [], ""
    for text in response.iter_text():
        buffer += text
        while "\n\n" in buffer and len(events) < count:
            event, buffer = buffer.split("\n\n", 1)
            events.append(json.loads(event.removeprefix("data: ")))
        if len(events) == count:
            return events
    raise AssertionError(f"the stream ended after {len(events)} events")


def test_the_stream_sends_history_once_then_new_points(web_server):
    time.sleep(1.2)  # the server keeps a history point per second: let there be one
    headers = {"Authorization": f"Bearer {web_server.api_key}"}
    with httpx.stream("GET", f"{web_server.url}/v1/engine/state/stream?interval=0.25", headers=headers,
                      timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = read_events(response, 9)
    first = events[0]["history"]["time"]
    assert len(first) >= 1 and set(events[0]["history"]) >= {"generation_tokens_per_s", "kv_cache_usage",
                                                              "num_running", "num_waiting", "num_preemptions"}
    later = [t for event in events[1:] for t in event["history"]["time"]]
    assert later == sorted(later) and all(t > first[-1] for t in later)  # only newer points, each once
    assert len(later) >= 1  # 2 s of events span at least one new one-second point
    gaps = [b["time"] - a["time"] for a, b in zip(events, events[1:])]
    assert min(gaps) >= 0.2 and sum(gaps) / len(gaps) < 0.6, gaps  # about 4 a second, never more


@pytest.mark.parametrize("interval", ["0.01", "11", "soon"])
def test_a_bad_interval_is_a_clear_400(web_server, interval):
    response = httpx.get(f"{web_server.url}/v1/engine/state/stream", params={"interval": interval},
                         headers={"Authorization": f"Bearer {web_server.api_key}"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "interval"
