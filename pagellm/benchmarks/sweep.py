"""`pagellm bench sweep`: throughput and mean time per output token against concurrency, written to CSV and
plotted to PNG.

At each concurrency c, c requests of the same prompt and output length run together (`bench latency`'s
measurement at batch c): total tokens/s is c x (input + output) over the whole run, and the time per output token
is the decode time over output_len. llama.cpp runs its c sequences together (a KV stream each, as
`llama-batched-bench`).
"""
from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

from pagellm.benchmarks.latency_backends import LatencyResult, bench_hf, bench_llama_cpp, bench_pagellm

FIELDS = ["backend", "concurrency", "total_tok_s", "output_tok_s", "tpot_ms", "prefill_tok_s", "decode_tok_s"]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")],
                        default=[1, 2, 4, 8, 16, 32, 64], help="comma-separated")
    parser.add_argument("--backends", type=lambda s: s.split(","), default=["pagellm", "hf"],
                        help="comma-separated, from pagellm, hf, llama.cpp")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", type=Path, default=Path("sweep"),
                        help="writes OUTPUT.csv and OUTPUT.png")
    parser.add_argument("--compare-max-num-seqs", type=lambda s: [int(m) for m in s.split(",")], default=None,
                        help="comma-separated: with --target-tpot-ms, pagellm alone, the target against these fixed "
                             "--max-num-seqs and the default, p99 TPOT per request (see sweep_target.py)")


def row(result: LatencyResult, input_len: int, output_len: int) -> dict[str, float | str | int]:
    c = result.batch_size
    prefill_s = c * input_len / result.prefill_tok_s
    decode_s = c * output_len / result.decode_tok_s
    return {"backend": result.backend, "concurrency": c,
            "total_tok_s": round(c * (input_len + output_len) / (prefill_s + decode_s), 2),
            "output_tok_s": round(c * output_len / (prefill_s + decode_s), 2),
            "tpot_ms": round(1e3 * decode_s / output_len, 3),
            "prefill_tok_s": round(result.prefill_tok_s, 2), "decode_tok_s": round(result.decode_tok_s, 2)}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        points = sorted((r["concurrency"], r["total_tok_s"], r["tpot_ms"]) for r in rows if r["backend"] == backend)
        xs = [p[0] for p in points]
        left.plot(xs, [p[1] for p in points], marker="o", label=backend)
        right.plot(xs, [p[2] for p in points], marker="o", label=backend)
    for axis, label in ((left, "total tokens/s"), (right, "mean time per output token (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(args: argparse.Namespace) -> None:
    from pagellm import LLM
    from pagellm.benchmarks.machine import machine_header
    from pagellm.benchmarks.throughput import load_hf_model
    from pagellm.engine.arg_utils import EngineArgs

    if args.compare_max_num_seqs is not None:
        if args.target_tpot_ms is None:
            raise SystemExit("--compare-max-num-seqs compares fixed settings with a latency target: give "
                             "--target-tpot-ms too.")
        from pagellm.benchmarks import sweep_target
        return sweep_target.run(args)
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    model_config = llm.llm_engine.config.model_config
    device = llm.llm_engine.config.device_config.device
    hf_model = load_hf_model(model_config.model, model_config.dtype, device) if "hf" in args.backends else None
    print(machine_header(), flush=True)
    rng = random.Random(0)
    rows = []
    for c in args.concurrency:
        prompts = [[rng.randrange(256, model_config.vocab_size) for _ in range(args.input_len)] for _ in range(c)]
        results = []
        if "pagellm" in args.backends:
            results.append(bench_pagellm(llm, prompts, args.output_len, args.repeats, step_split=False))
        if hf_model is not None:
            results.append(bench_hf(hf_model, prompts, args.output_len, args.repeats))
        if "llama.cpp" in args.backends and model_config.gguf_file:
            results.append(bench_llama_cpp("llama.cpp", Path(model_config.gguf_file), prompts, args.output_len,
                                           args.repeats, model_config.hf_config))
        for result in results:
            rows.append(row(result, args.input_len, args.output_len))
            print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    csv_path, png_path = args.output.with_suffix(".csv"), args.output.with_suffix(".png")
    write_csv(rows, FIELDS, csv_path)
    plot(rows, png_path, f"{model_config.served_model_name} ({model_config.quantization}), {args.input_len} in + "
                         f"{args.output_len} out\n{machine_header()}")
    print(f"wrote {csv_path} and {png_path}")


def write_csv(rows: list[dict], fields: list[str], path: Path) -> None:
    """The sweep's rows as a CSV file (its folder made if need be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
