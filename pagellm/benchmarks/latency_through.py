"""`pagellm bench latency --through generate|server`: the same prompts timed where users meet the engine, next to
the engine's own steps.

- `generate`: `LLM.generate()` on the prompts, as a script calls it (the Python loop, output objects and
  detokenization included). Prefill is the best time of a 1-token generation; decode is the best time of
  1 + output_len tokens minus that, over batch x output_len tokens: the method of the peers' figures.
- `server`: the OpenAI server (uvicorn, AsyncLLM, SSE, JSON), started in a child process with the same engine
  arguments, and one streamed `/v1/completions` request per prompt, all at once. Prefill is the time until every
  stream has its first token; decode is the tokens after the first over the time after that, and the mean time
  between a stream's tokens (TPOT) is printed too.

Each run changes the prompts' first token (to values the engine-step runs did not use), so the prefix cache never
serves a run from one before.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

THROUGH = ("step", "generate", "server")
# First-token shifts past those of the engine-step runs (latency_backends.bench_pagellm counts from 1) in the same
# engine.
GENERATE_SHIFTS = 1000


def shifted(prompts: list[list[int]], shift: int, vocab: int) -> list[list[int]]:
    return [[(p[0] + shift) % vocab, *p[1:]] for p in prompts]


def generate_seconds(llm, prompts: list[list[int]], output_len: int, repeats: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) through LLM.generate(), each the best of `repeats`."""
    from pagellm import SamplingParams

    vocab = llm.llm_engine.config.model_config.vocab_size
    runs = itertools.count(GENERATE_SHIFTS)

    def run(n: int) -> float:
        batch = [{"prompt_token_ids": p} for p in shifted(prompts, next(runs), vocab)]
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start

    run(2)  # warm-up
    prefill = min(run(1) for _ in range(repeats))
    total = min(run(1 + output_len) for _ in range(repeats))
    return prefill, max(total - prefill, 1e-9)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(engine_args, port: int) -> None:
    """The child process: the OpenAI server over these engine arguments, until terminated."""
    import uvicorn

    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.openai.api_server import ServerConfig, build_app

    engine = AsyncLLM.from_engine_args(engine_args, log_stats=False)
    name = engine.config.model_config.served_model_name
    assert name is not None  # EngineArgs always names the model
    app = build_app(engine, ServerConfig(served_model_names=[name]))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


@contextmanager
def running_server(engine_args, timeout_s: float = 600.0) -> Iterator[str]:
    """The server's base URL while it runs (a spawned child, so it shares nothing with this process's engine)."""
    port = _free_port()
    process = multiprocessing.get_context("spawn").Process(target=_serve, args=(engine_args, port), daemon=True)
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if not process.is_alive():
                raise SystemExit(f"the benchmark's server exited with code {process.exitcode} before serving")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the benchmark's server did not answer /health within {timeout_s:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.join(30)


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
                  ) -> list[float]:
    """The arrival time of each streamed chunk that carries text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"the server refused the benchmark's request: {response.status_code} "
                             f"{(await response.aread()).decode(errors='replace')[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            if json.loads(line[5:])["choices"][0].get("text"):
                times.append(time.perf_counter())
    return times


def server_seconds(url: str, model: str, prompts: list[list[int]], output_len: int, repeats: int, vocab: int
                   ) -> tuple[float, float, float]:
    """(prefill seconds, decode seconds, mean TPOT seconds) through the server, the best run of `repeats`; decode
    counts the batch's streamed chunks after the first of each (one token each, unless detokenization held some
    back: then the chunk count is lower and the figure conservative)."""
    runs = itertools.count(1)

    async def run() -> tuple[float, float, int, float]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
            start = time.perf_counter()
            streams = await asyncio.gather(*(_stream(client, url, model, p, 1 + output_len)
                                             for p in shifted(prompts, next(runs), vocab)))
        first = max(times[0] for times in streams) - start
        decode = max(times[-1] for times in streams) - (start + first)
        gaps = [b - a for times in streams for a, b in zip(times, times[1:])]
        return first, decode, sum(len(times) - 1 for times in streams), sum(gaps) / max(len(gaps), 1)

    asyncio.run(run())  # warm-up
    measured = [asyncio.run(run()) for _ in range(repeats)]
    prefill = min(m[0] for m in measured)
    best = max(measured, key=lambda m: m[2] / max(m[1], 1e-9))
    tokens = len(prompts) * output_len
    return prefill, best[1] * tokens / max(best[2], 1), min(m[3] for m in measured)
