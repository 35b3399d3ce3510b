"""The load `bench serve` (and `bench soak`) puts on a server under test: its address and model, the requests'
arrival times (Poisson or gamma gaps), and each streamed request timed chunk by chunk, at most `--max-concurrency`
in flight."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from pagellm.benchmarks.serve_prompts import BenchPrompt


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The flags that name the server under test (shared by `bench serve` and `bench soak`)."""
    parser.add_argument("--base-url", default=None, help="server root (default http://127.0.0.1:8000)")
    parser.add_argument("--host", default=None, help="server host, instead of --base-url (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="server port, instead of --base-url (default 8000)")
    parser.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    parser.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY or $PAGELLM_API_KEY")


def server_address(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    """(base URL, auth headers) from the flags of `add_server_args`."""
    if args.host is not None or args.port is not None:
        base_url = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    else:
        base_url = (args.base_url or "http://127.0.0.1:8000").rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("PAGELLM_API_KEY")
    return base_url, {"Authorization": f"Bearer {api_key}"} if api_key else {}


def listed_model(base_url: str, headers: dict) -> str | None:
    """GET /v1/models: proves the server is reachable before the run, and names its first model, if any."""
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc}); is it "
                              f"running? Pass --base-url or --host/--port") from None
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
        return response.json()["data"][0]["id"] if response.status_code == 200 else None
    return None


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send time of each request in seconds from the start; the first goes at once."""
    if math.isinf(rate):
        return np.zeros(n)
    # Gamma gaps of shape k and scale 1 / (rate * k) keep the mean at 1 / rate while the variance is
    # 1 / (rate^2 * k); k = 1 gives exponential gaps, i.e. Poisson arrivals.
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def build_payload(backend: str, model: str, prompt: BenchPrompt, ignore_eos: bool) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if backend == "openai-chat":
        body.update(messages=[{"role": "user", "content": prompt.prompt}], max_completion_tokens=prompt.output_len)
    else:
        body.update(prompt=prompt.prompt, max_tokens=prompt.output_len)
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_request(client: httpx.AsyncClient, url: str, headers: dict, payload: dict, chat: bool,
                       prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    text_chunks, usage = 0, None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace").strip()
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error in stream: {chunk['error']}"
                    return result
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or [{}]
                text = (choices[0].get("delta") or {}).get("content") if chat else choices[0].get("text")
                if text:
                    now = time.perf_counter()
                    if text_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, text_chunks = now, text_chunks + 1
    except Exception as exc:  # one broken request is a failure to count, not a reason to stop the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    if text_chunks == 0:
        result.error = "the stream ended without generated text"
        return result
    # The server's usage is the truth (a chunk may carry several tokens; chat templates add prompt tokens).
    result.output_tokens = (usage or {}).get("completion_tokens") or text_chunks
    result.prompt_len = (usage or {}).get("prompt_tokens") or prompt_len
    result.success = True
    return result


async def benchmark(url: str, headers: dict, payloads: list[dict], prompt_lens: list[int], chat: bool,
                    offsets: np.ndarray, max_concurrency: int | None,
                    disable_tqdm: bool) -> tuple[list[RequestResult], float]:
    from tqdm.auto import tqdm

    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    progress = tqdm(total=len(payloads), disable=disable_tqdm)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            # Sleep to the planned absolute send time, so slow responses never delay later arrivals.
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with semaphore:
                result = await send_request(client, url, headers, payloads[i], chat, prompt_lens[i])
            progress.update(1)
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(payloads))))
        duration = time.perf_counter() - start
    progress.close()
    return list(results), duration
