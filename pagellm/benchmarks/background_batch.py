"""`pagellm bench serve --background-batch N`: a batch job of N requests submitted through `/v1/files` and
`/v1/batches` while the interactive load runs again, so one run reports interactive TTFT without and with batch work
behind it. Batch lines run at the lowest priority: only a server started with `--scheduling-policy priority` serves
the interactive requests first (under fcfs batch lines and interactive requests share the queue in arrival order)."""
from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass

import httpx

_POLL_S = 0.2


@dataclass
class BackgroundBatch:
    base_url: str
    headers: dict
    batch_id: str | None = None

    def submit(self, endpoint: str, payloads: list[dict]) -> None:
        """Uploads the payloads (unstreamed) as a batch input file and creates the batch; waits until it runs."""
        lines = []
        for i, payload in enumerate(payloads):
            body = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
            lines.append(json.dumps({"custom_id": f"bg-{i}", "method": "POST", "url": endpoint, "body": body}))
        data = ("\n".join(lines) + "\n").encode()
        with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=30.0) as client:
            upload = client.post("/v1/files", data={"purpose": "batch"},
                                 files={"file": ("background.jsonl", io.BytesIO(data), "application/jsonl")})
            upload.raise_for_status()
            batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": endpoint,
                                                     "completion_window": "24h"})
            batch.raise_for_status()
            self.batch_id = batch.json()["id"]
            while self.status()["status"] == "validating":
                time.sleep(_POLL_S)

    def status(self) -> dict:
        response = httpx.get(f"{self.base_url}/v1/batches/{self.batch_id}", headers=self.headers, timeout=30.0)
        response.raise_for_status()
        return response.json()

    def cancel(self) -> dict:
        """Cancels what is left (the interactive load has ended) and returns the batch as it stood."""
        before = self.status()
        httpx.post(f"{self.base_url}/v1/batches/{self.batch_id}/cancel", headers=self.headers,
                   timeout=60.0).raise_for_status()
        return before


def format_comparison(alone: dict, with_batch: dict, batch: dict) -> str:
    counts = batch["request_counts"]
    lines = ["{s:{c}^50}".format(s=" Interactive TTFT with a background batch ", c="="),
             f"{'Batch status during the load:':<40} {batch['status']:<10}",
             f"{'Batch lines done / total:':<40} {counts['completed'] + counts['failed']}/{counts['total']}"]
    for stat in ("mean", "median", "p99"):
        key = f"{stat}_ttft_ms"
        if key in alone and key in with_batch:
            ratio = with_batch[key] / alone[key] if alone[key] else float("nan")
            lines.append(f"{f'{stat.capitalize()} TTFT alone / with (ms):':<40} "
                         f"{alone[key]:.2f} / {with_batch[key]:.2f} ({ratio:.2f}x)")
    lines.append("=" * 50)
    return "\n".join(lines)
