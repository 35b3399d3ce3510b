"""`pagellm bench serve`: load-test any OpenAI-compatible server over HTTP, like `vllm bench serve`.

Requests arrive as a Poisson process at `--request-rate` (gamma-distributed gaps with `--burstiness` != 1), at
most `--max-concurrency` in flight. Every request streams, and the client timestamps each chunk that carries
text: TTFT is the first such chunk, ITL the gaps between later ones, E2EL the end of the stream, and TPOT
(E2EL - TTFT) / (output tokens - 1). This module holds the command (its flags, checks and run); the prompts are
built in serve_prompts.py, sent and timed in serve_load.py, and the statistics computed in serve_metrics.py.

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
import json
import math
from pathlib import Path

from pagellm.benchmarks.engine_state_watch import EngineStateWatch
from pagellm.benchmarks.serve_load import (
    add_server_args,
    arrival_offsets,
    benchmark,
    build_payload,
    listed_model,
    server_address,
)
from pagellm.benchmarks.serve_metrics import METRICS, class_metrics, compute_metrics, format_report
from pagellm.benchmarks.serve_prompts import file_prompts, load_tokenizer, mixed_prompts, random_prompts


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
