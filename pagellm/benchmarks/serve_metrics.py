"""`bench serve`'s results: vLLM's serving metrics (throughput; TTFT, TPOT, ITL and E2EL statistics) computed from
the requests' timings apart from the HTTP code, so they can be tested on synthetic ones; TTFT per request class for
`--mix`; the printed report."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagellm.benchmarks.serve_load import RequestResult

METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


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
