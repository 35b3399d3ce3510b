"""What `pagellm bench soak` records and reports: each request's outcome, the server's state read from /metrics
(requests running and waiting, KV blocks in use, RSS), the drain after the traffic, and the report with the
checks the server must pass.

RSS is read at the start, halfway and at the end. The KV pool is mapped at start-up but becomes resident only as
its blocks are first used, so RSS grows early in a run by up to the pool's size; growth after the whole pool has
been used would be a leak."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

BODY_SAMPLE_CHARS = 300
MAX_UNEXPECTED_SAMPLES = 20
DRAIN_POLL_S = 0.25
MIB = 1 << 20
SERVER_GAUGES = {"running": "pagellm:num_requests_running", "waiting": "pagellm:num_requests_waiting",
                 "used_blocks": "pagellm:kv_cache_used_blocks", "rss_bytes": "process_resident_memory_bytes"}


@dataclass(slots=True)
class Outcome:
    kind: str
    expected_status: int  # 200 for good requests
    status: int | None = None  # None: no response headers (abandoned early, or a transport error)
    served: bool = False  # 200 and read to the end, with every asked-for choice finished
    abandoned: bool = False
    body: str = ""  # the response body, or the last stream event
    error: str = ""  # a transport error, or a body that is not the JSON it should be

    @property
    def unexpected(self) -> bool:
        if self.abandoned:  # only good requests are abandoned; headers, if any came, must have said 200
            return self.status not in (None, 200)
        return self.status != self.expected_status if self.expected_status != 200 else not self.served


@dataclass(frozen=True, slots=True)
class ServerState:
    running: float
    waiting: float
    used_blocks: float
    rss_bytes: float

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.used_blocks == 0


def parse_server_state(metrics_text: str) -> ServerState:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:  # summed over the engine (data-parallel replica) label
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    missing = [name for name in SERVER_GAUGES.values() if name not in values]
    if missing:
        raise ValueError(f"/metrics lacks {', '.join(missing)}")
    return ServerState(**{key: values[name] for key, name in SERVER_GAUGES.items()})


async def fetch_state(client: httpx.AsyncClient, base_url: str) -> ServerState:
    response = await client.get(f"{base_url}/metrics")
    response.raise_for_status()
    return parse_server_state(response.text)


async def drain(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> ServerState | None:
    """The server state once idle, or at the deadline; None if /metrics no longer answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = await fetch_state(client, base_url)
        except httpx.HTTPError:
            return None
        if state.idle or time.monotonic() >= deadline:
            return state
        await asyncio.sleep(DRAIN_POLL_S)


async def health_status(client: httpx.AsyncClient, base_url: str) -> int | None:
    try:
        return (await client.get(f"{base_url}/health")).status_code
    except httpx.HTTPError:
        return None


@dataclass(slots=True)
class SoakReport:
    duration_s: float
    requests_sent: int
    served: int
    abandoned: int
    bad_sent: int
    bad_rejected_as_expected: int
    errors_by_status: dict[str, int]  # every 4xx / 5xx status received, as a string (JSON keys are strings)
    unexpected: int
    unexpected_samples: list[dict]  # the first MAX_UNEXPECTED_SAMPLES, each with a sample of its body
    kv_blocks_used_after_drain: int | None  # None: /metrics did not answer after the run
    running_after_drain: int | None
    waiting_after_drain: int | None
    rss_start_mib: float
    rss_end_mib: float | None
    health_status: int | None
    rss_halfway_mib: float | None = None

    def problems(self) -> list[str]:
        """Why the server failed the soak; empty when it passed."""
        server_errors = sum(count for status, count in self.errors_by_status.items() if status.startswith("5"))
        checks = [(server_errors == 0, f"{server_errors} responses with a 5xx status"),
                  (self.unexpected == 0, f"{self.unexpected} unexpected outcomes"),
                  (self.kv_blocks_used_after_drain == 0, f"KV blocks in use after the drain: "
                                                         f"{self.kv_blocks_used_after_drain}"),
                  (self.running_after_drain == 0 and self.waiting_after_drain == 0,
                   f"requests after the drain: {self.running_after_drain} running, {self.waiting_after_drain} "
                   f"waiting"),
                  (self.health_status == 200, f"/health answered {self.health_status} at the end")]
        return [message for ok, message in checks if not ok]

    @property
    def exit_status(self) -> int:
        return 1 if self.problems() else 0

    def format(self) -> str:
        rss = " / ".join("-" if value is None else f"{value:.1f}"
                         for value in (self.rss_start_mib, self.rss_halfway_mib, self.rss_end_mib))
        rows = [("Duration (s):", f"{self.duration_s:.1f}"), ("Requests sent:", self.requests_sent),
                ("Served (200, read to the end):", self.served), ("Abandoned by the client:", self.abandoned),
                ("Bad requests sent:", self.bad_sent),
                ("Bad ones refused as expected:", self.bad_rejected_as_expected),
                ("Errors by status:", json.dumps(self.errors_by_status, sort_keys=True)),
                ("Unexpected outcomes:", self.unexpected),
                ("KV blocks in use after drain:", self.kv_blocks_used_after_drain),
                ("Running / waiting after drain:", f"{self.running_after_drain} / {self.waiting_after_drain}"),
                ("Server RSS start / halfway / end (MiB):", rss),
                ("/health at the end:", self.health_status)]
        lines = ["{s:{c}^60}".format(s=" Soak Test Result ", c="=")]
        lines += [f"{label:<40} {value}" for label, value in rows]
        lines += [f"  unexpected: {json.dumps(sample)}" for sample in self.unexpected_samples]
        problems = self.problems()
        lines.append("=" * 60)
        lines.append("FAILED: " + "; ".join(problems) if problems else "PASSED")
        return "\n".join(lines)


def summarize(outcomes: Sequence[Outcome], duration_s: float, start: ServerState, end: ServerState | None,
              health_status: int | None, halfway: ServerState | None = None) -> SoakReport:
    bad = [o for o in outcomes if o.expected_status != 200]
    unexpected = [o for o in outcomes if o.unexpected]
    statuses = Counter(str(o.status) for o in outcomes if o.status is not None and o.status >= 400)
    samples = [{"kind": o.kind, "expected": o.expected_status, "status": o.status,
                "error": o.error, "body": o.body[:BODY_SAMPLE_CHARS]}
               for o in unexpected[:MAX_UNEXPECTED_SAMPLES]]
    return SoakReport(
        duration_s=duration_s, requests_sent=len(outcomes), served=sum(o.served for o in outcomes),
        abandoned=sum(o.abandoned for o in outcomes), bad_sent=len(bad),
        bad_rejected_as_expected=sum(o.status == o.expected_status for o in bad),
        errors_by_status=dict(sorted(statuses.items())), unexpected=len(unexpected), unexpected_samples=samples,
        kv_blocks_used_after_drain=None if end is None else int(end.used_blocks),
        running_after_drain=None if end is None else int(end.running),
        waiting_after_drain=None if end is None else int(end.waiting),
        rss_start_mib=start.rss_bytes / MIB, rss_end_mib=None if end is None else end.rss_bytes / MIB,
        health_status=health_status, rss_halfway_mib=None if halfway is None else halfway.rss_bytes / MIB)


