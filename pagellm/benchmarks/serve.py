"""`pagellm bench serve`: load-test any OpenAI-compatible server over HTTP, like `vllm bench serve`.

Requests arrive as a Poisson process at `--request-rate` (gamma-distributed gaps with `--burstiness` != 1), at
most `--max-concurrency` in flight. Every request streams, and the client timestamps each chunk that carries
text: TTFT is the first such chunk, ITL the gaps between later ones, E2EL the end of the stream, and TPOT
(E2EL - TTFT) / (output tokens - 1). `compute_metrics` holds the maths apart from the HTTP code so it can be
tested on synthetic timings.

`--mix FRACTION:INPUT_LEN:OUTPUT_LEN` makes that share of the random requests long ones and reports TTFT per class:
p50 and p99 of the short requests, the longest wait of a long one. It compares scheduling policies, which are a
server flag: serve the model once per policy and run the same load against each, e.g.

    pagellm serve --port 8011 --scheduling-policy fcfs          # then again with short-first
    pagellm bench serve --port 8011 --num-prompts 60 --random-input-len 64 --random-output-len 32 \
        --mix 0.1:1024:128 --request-rate 2
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from pagellm.benchmarks.engine_state_watch import EngineStateWatch

METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass(slots=True)
class BenchPrompt:
    prompt: str
    prompt_len: int
    output_len: int


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


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["openai", "openai-chat"], default="openai",
                        help="openai: /v1/completions with a prompt; openai-chat: /v1/chat/completions with messages")
    add_server_args(parser)
    parser.add_argument("--endpoint", default=None, help="default /v1/completions, or /v1/chat/completions for chat")
    parser.add_argument("--tokenizer", default=None, help="builds and counts prompts (default: the default model's)")
    parser.add_argument("--dataset-name", choices=["random"], default="random")
    parser.add_argument("--dataset-path", default=None,
                        help="prompts file instead of random ones: one per line (.txt) or JSONL with a 'prompt' field")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128, help="max_tokens (also with --dataset-path)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    parser.add_argument("--mix", type=parse_mix, default=None, metavar="FRACTION:INPUT_LEN:OUTPUT_LEN",
                        help="make this share of the random requests long ones of these lengths, and report TTFT "
                             "of short and long requests apart (to compare --scheduling-policy of servers)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send ignore_eos (a vLLM extra) to servers that reject it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="per second (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--percentile-metrics", default=",".join(METRICS), help="comma-separated subset of the default")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    parser.add_argument("--watch-engine-state", type=float, default=None, metavar="SECONDS",
                        help="keep pagellm's /v1/engine/state/stream open during the run, an event every SECONDS "
                             "(what an open /dashboard costs)")
    parser.add_argument("--background-batch", type=int, default=0, metavar="N",
                        help="after the run, submit a batch job of N such requests through /v1/batches and run the "
                             "same load again beside it: TTFT without and with (serve with --scheduling-policy "
                             "priority so that interactive requests go first)")
    parser.add_argument("--save-result", default=None, metavar="FILE", help="write the metrics as JSON")
    parser.add_argument("--disable-tqdm", action="store_true")


def parse_mix(text: str) -> tuple[float, int, int]:
    try:
        fraction, input_len, output_len = text.split(":")
        mix = float(fraction), int(input_len), int(output_len)
    except ValueError:
        mix = None
    if mix is None or not (0 < mix[0] < 1 and mix[1] >= 1 and mix[2] >= 1):
        raise argparse.ArgumentTypeError(f"invalid --mix {text!r}: use FRACTION:INPUT_LEN:OUTPUT_LEN with "
                                         f"0 < FRACTION < 1, e.g. 0.1:1024:128")
    return mix


def compute_metrics(results: list[RequestResult], duration: float, selected: Sequence[str] = tuple(METRICS),
                    percentiles: Sequence[float] = (99.0,)) -> dict:
    """vLLM's serving metrics over the successful requests; latencies in ms, 0 where there are no samples."""
    ok = [r for r in results if r.success]
    input_tokens, output_tokens = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    duration = max(duration, 1e-9)
    metrics: dict = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
                     "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
                     "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
                     "total_token_throughput": (input_tokens + output_tokens) / duration}
    # The first token pays for the prefill, so TPOT spreads only the rest of the time over the other tokens.
    samples = {"ttft": [r.ttft for r in ok], "itl": [gap for r in ok for gap in r.itl], "e2el": [r.latency for r in ok],
               "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]}
    for name in selected:
        values = np.asarray(samples[name] or [0.0]) * 1000.0
        metrics[f"mean_{name}_ms"] = float(np.mean(values))
        metrics[f"median_{name}_ms"] = float(np.median(values))
        metrics[f"std_{name}_ms"] = float(np.std(values))
        for p in percentiles:
            metrics[f"p{p:g}_{name}_ms"] = float(np.percentile(values, p))
    metrics["errors"] = [r.error for r in results if not r.success]
    return metrics


def class_metrics(results: list[RequestResult], is_long: list[bool]) -> dict:
    """TTFT of the short requests (p50, p99) and the longest TTFT of a long one, in ms, for `--mix`."""
    short = compute_metrics([r for r, long in zip(results, is_long) if not long], 1.0, ["ttft"], [50, 99])
    long = compute_metrics([r for r, long in zip(results, is_long) if long], 1.0, ["ttft"], [100])
    return {"short_completed": short["completed"], "short_p50_ttft_ms": short["p50_ttft_ms"],
            "short_p99_ttft_ms": short["p99_ttft_ms"], "long_completed": long["completed"],
            "long_max_ttft_ms": long["p100_ttft_ms"]}


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send time of each request in seconds from the start; the first goes at once."""
    if math.isinf(rate):
        return np.zeros(n)
    # Gamma gaps of shape k and scale 1 / (rate * k) keep the mean at 1 / rate while the variance is
    # 1 / (rate^2 * k); k = 1 gives exponential gaps, i.e. Poisson arrivals.
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str | None):
    from pagellm.model_executor.model_loader.resolve import resolve_model_dir
    from pagellm.transformers_utils.tokenizer import get_tokenizer

    if name is None or name.endswith(".gguf"):
        return get_tokenizer(resolve_model_dir(name))
    return get_tokenizer(name)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    low = max(1, math.floor(mean * (1 - ratio)))
    return rng.integers(low, max(low, math.ceil(mean * (1 + ratio))) + 1, size=n).tolist()


def random_prompts(tokenizer, n: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[BenchPrompt]:
    rng = np.random.default_rng(seed)
    input_lens, output_lens = _lengths(rng, input_len, ratio, n), _lengths(rng, output_len, ratio, n)
    special = set(tokenizer.all_special_ids)
    allowed = np.array([i for i in range(len(tokenizer)) if i not in special])
    prompts = []
    for in_len, out_len in zip(input_lens, output_lens):
        # Decoding random ids and re-encoding the text can merge or split tokens; trim so the server sees at most
        # in_len tokens, and count what it will actually see.
        ids = tokenizer.encode(tokenizer.decode(rng.choice(allowed, size=in_len).tolist()),
                               add_special_tokens=False)[:in_len]
        prompts.append(BenchPrompt(tokenizer.decode(ids), len(ids), out_len))
    return prompts


def mixed_prompts(tokenizer, n: int, input_len: int, output_len: int, ratio: float, mix: tuple[float, int, int],
                  seed: int) -> tuple[list[BenchPrompt], list[bool]]:
    """Random prompts of which round(fraction * n) (at least one), at places drawn from the seed, are long; and
    which ones those are."""
    fraction, long_input_len, long_output_len = mix
    num_long = min(n, max(1, round(fraction * n)))
    long_at = set(np.random.default_rng(seed).choice(n, size=num_long, replace=False).tolist())
    short = iter(random_prompts(tokenizer, n - num_long, input_len, output_len, ratio, seed))
    long = iter(random_prompts(tokenizer, num_long, long_input_len, long_output_len, ratio, seed + 1))
    return [next(long) if i in long_at else next(short) for i in range(n)], [i in long_at for i in range(n)]


def file_prompts(path: str, tokenizer, n: int, output_len: int, ratio: float, seed: int) -> list[BenchPrompt]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--dataset-path {path} is not a file")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    try:
        texts = [json.loads(line)["prompt"] for line in lines] if file.suffix in (".jsonl", ".json") else lines
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: every line must be a JSON object with a 'prompt' field ({exc})") from exc
    if not texts:
        raise ValueError(f"{path} holds no prompts")
    texts = [texts[i % len(texts)] for i in range(n)]  # cycle through the file to reach --num-prompts
    output_lens = _lengths(np.random.default_rng(seed), output_len, ratio, n)
    return [BenchPrompt(text, len(tokenizer.encode(text, add_special_tokens=False)), out_len)
            for text, out_len in zip(texts, output_lens)]


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


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _validate(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    selected, percentiles = _csv(args.percentile_metrics), [float(p) for p in _csv(args.metric_percentiles)]
    checks = [(args.num_prompts >= 1, "--num-prompts must be >= 1"),
              (args.random_input_len >= 1 and args.random_output_len >= 1, "random lengths must be >= 1"),
              (0 <= args.random_range_ratio < 1, "--random-range-ratio must be in [0, 1)"),
              (not (args.mix and args.dataset_path), "--mix applies to random prompts, not --dataset-path"),
              (args.request_rate > 0 and args.burstiness > 0, "--request-rate and --burstiness must be > 0"),
              (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be >= 1"),
              (all(m in METRICS for m in selected), f"--percentile-metrics: choose from {','.join(METRICS)}"),
              (all(0 <= p <= 100 for p in percentiles), "--metric-percentiles must be in [0, 100]"),
              (args.watch_engine_state is None or args.watch_engine_state > 0, "--watch-engine-state must be > 0"),
              (args.background_batch >= 0, "--background-batch must be >= 0")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    return selected, percentiles


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


def format_report(metrics: dict, selected: list[str], percentiles: list[float], max_concurrency: int | None) -> str:
    rows = [("Successful requests:", metrics["completed"]), ("Failed requests:", metrics["failed"])]
    if max_concurrency:
        rows.append(("Maximum request concurrency:", max_concurrency))
    rows += [("Benchmark duration (s):", f"{metrics['duration']:.2f}"),
             ("Total input tokens:", metrics["total_input_tokens"]),
             ("Total generated tokens:", metrics["total_output_tokens"]),
             ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
             ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{label:<40} {value:<10}" for label, value in rows]
    for name in selected:
        lines.append("{s:{c}^50}".format(s=METRICS[name], c="-"))
        upper = name.upper()
        lines += [f"{f'{stat.capitalize()} {upper} (ms):':<40} {metrics[f'{stat}_{name}_ms']:<10.2f}"
                  for stat in ("mean", "median", "std")]
        lines += [f"{f'P{p:g} {upper} (ms):':<40} {metrics[f'p{p:g}_{name}_ms']:<10.2f}" for p in percentiles]
    if "long_max_ttft_ms" in metrics:
        lines.append("{s:{c}^50}".format(s="TTFT by request class (--mix)", c="-"))
        lines += [f"{'Short requests completed:':<40} {metrics['short_completed']:<10}",
                  f"{'Short P50 TTFT (ms):':<40} {metrics['short_p50_ttft_ms']:<10.2f}",
                  f"{'Short P99 TTFT (ms):':<40} {metrics['short_p99_ttft_ms']:<10.2f}",
                  f"{'Long requests completed:':<40} {metrics['long_completed']:<10}",
                  f"{'Long max TTFT (ms):':<40} {metrics['long_max_ttft_ms']:<10.2f}"]
    lines.append("=" * 50)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    selected, percentiles = _validate(args)
    base_url, headers = server_address(args)
    chat = args.backend == "openai-chat"
    url = base_url + (args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions"))
    listed = listed_model(base_url, headers)  # probed even with --model: an unreachable server fails fast
    model = args.model or listed
    if model is None:
        raise ValueError(f"{base_url}/v1/models names no model; pass --model")

    tokenizer = load_tokenizer(args.tokenizer)
    is_long = None
    if args.dataset_path:
        prompts = file_prompts(args.dataset_path, tokenizer, args.num_prompts, args.random_output_len,
                               args.random_range_ratio, args.seed)
    elif args.mix:
        prompts, is_long = mixed_prompts(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                         args.random_range_ratio, args.mix, args.seed)
    else:
        prompts = random_prompts(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, args.seed)
    payloads = [build_payload(args.backend, model, p, args.ignore_eos) for p in prompts]
    offsets = arrival_offsets(len(prompts), args.request_rate, args.burstiness, args.seed)
    print(f"{len(prompts)} requests to {url} (model {model}), request rate {args.request_rate}, burstiness "
          f"{args.burstiness}, max concurrency {args.max_concurrency}")

    def load():
        return benchmark(url, headers, payloads, [p.prompt_len for p in prompts], chat, offsets,
                         args.max_concurrency, args.disable_tqdm)

    watch = EngineStateWatch(base_url, headers, args.watch_engine_state) if args.watch_engine_state else None
    results, duration = asyncio.run(watch.during(load()) if watch else load())
    metrics = compute_metrics(results, duration, selected, percentiles)
    if watch:
        print(f"Engine state events received: {watch.num_events} ({watch.num_bytes / max(watch.num_events, 1):.0f} "
              f"bytes each on average)")
        metrics["engine_state_events"] = watch.num_events
    if is_long is not None:
        metrics.update(class_metrics(results, is_long))
    if metrics["errors"]:
        print(f"{metrics['failed']} requests failed; first errors:")
        for error in list(dict.fromkeys(metrics["errors"]))[:3]:  # distinct ones: one cause often fails many
            print(f"  {error}")
    print(format_report(metrics, selected, percentiles, args.max_concurrency))
    if args.background_batch:
        metrics["background_batch"] = _with_background_batch(args, base_url, headers, url[len(base_url):], payloads,
                                                             load, metrics, percentiles)
    if args.save_result:
        config = {k: getattr(args, k) for k in ("backend", "num_prompts", "burstiness", "max_concurrency", "seed",
                                                "mix")}
        config["request_rate"] = args.request_rate if math.isfinite(args.request_rate) else "inf"  # strict JSON
        Path(args.save_result).write_text(json.dumps({**config, "url": url, "model": model, **metrics}, indent=2))
    return metrics


def _with_background_batch(args: argparse.Namespace, base_url: str, headers: dict, endpoint: str,
                           payloads: list[dict], load, alone: dict, percentiles: list[float]) -> dict:
    """The same load again while a batch of --background-batch requests (the payloads, cycled) runs behind it."""
    from pagellm.benchmarks.background_batch import BackgroundBatch, format_comparison

    batch = BackgroundBatch(base_url, headers)
    batch.submit(endpoint, [payloads[i % len(payloads)] for i in range(args.background_batch)])
    try:
        results, duration = asyncio.run(load())
    finally:
        state = batch.cancel()
    with_batch = compute_metrics(results, duration, ["ttft"], percentiles)
    print(format_comparison(alone, with_batch, state))
    return {"batch_size": args.background_batch, "batch_status": state["status"],
            "batch_request_counts": state["request_counts"],
            **{k: v for k, v in with_batch.items() if k.endswith("_ttft_ms") or k in ("completed", "failed")}}
