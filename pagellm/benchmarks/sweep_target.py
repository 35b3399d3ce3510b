"""`pagellm bench sweep --target-tpot-ms T --compare-max-num-seqs 4,8,16,32`: the batch size chosen online against a
latency target, beside fixed `--max-num-seqs` settings and the default (256), at each concurrency.

At each concurrency c, c requests of the same prompt and output length arrive together and the engine runs them to
the end, stepped as `LLM.generate` steps it. Per request, TPOT is (last token - first token) / (output tokens - 1),
as vLLM's serving benchmark counts it; total tokens/s is c x (input + output) over the whole run. A fixed setting
that is at least c runs like the default, so it is not run again. Every setting's engine is loaded at once (each
with a KV pool of KV_BYTES unless --kv-cache-memory says otherwise), and each level runs on all of them one after
the other, so that a shared host's drift falls on every setting alike rather than on whichever ran in a slow
minute. The target engine keeps its step-time model from one level to the next, as a server would.
"""
from __future__ import annotations

import argparse
import gc
import random
import time
from pathlib import Path

import numpy as np

KV_BYTES = 1 << 30  # each engine's KV pool unless --kv-cache-memory says otherwise (the default model: 23k tokens)
FIELDS = ["setting", "concurrency", "total_tok_s", "output_tok_s", "mean_tpot_ms", "p99_tpot_ms", "mean_ttft_ms"]


def run_level(llm, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, float]:
    from pagellm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished_requests():
        outputs, _ = engine.step_outputs()
        now = time.perf_counter()
        for output in outputs:
            first.setdefault(output.request_id, now)
            last[output.request_id] = now
    elapsed = time.perf_counter() - start
    tpot = np.array([(last[r] - first[r]) / (output_len - 1) for r in first]) * 1e3
    ttft = np.array([first[r] - start for r in first]) * 1e3
    c, input_len = len(prompts), len(prompts[0])
    return {"total_tok_s": round(c * (input_len + output_len) / elapsed, 2),
            "output_tok_s": round(c * output_len / elapsed, 2), "mean_tpot_ms": round(float(tpot.mean()), 2),
            "p99_tpot_ms": round(float(np.percentile(tpot, 99)), 2), "mean_ttft_ms": round(float(ttft.mean()), 1)}


def run(args: argparse.Namespace) -> None:
    from pagellm import LLM
    from pagellm.benchmarks.machine import machine_header
    from pagellm.benchmarks.sweep import write_csv
    from pagellm.config import SchedulerConfig
    from pagellm.engine.arg_utils import EngineArgs

    base = vars(EngineArgs.from_cli_args(args))
    default = SchedulerConfig.max_num_seqs
    settings = [(f"target {args.target_tpot_ms:g} ms", {"max_num_seqs": "auto", "target_tpot_ms": args.target_tpot_ms}),
                (f"fixed {default} (default)", {"max_num_seqs": default, "target_tpot_ms": None}),
                *((f"fixed {m}", {"max_num_seqs": m, "target_tpot_ms": None}) for m in args.compare_max_num_seqs)]
    print(machine_header(), flush=True)
    if base["kv_cache_memory_bytes"] is None:
        base["kv_cache_memory_bytes"] = KV_BYTES
    engines = []
    for name, overrides in settings:
        levels = [c for c in args.concurrency if overrides["max_num_seqs"] in ("auto", default)
                  or overrides["max_num_seqs"] < c]
        if levels:
            llm = LLM(**{**base, **overrides})
            run_level(llm, [[7] * args.input_len], 4, "warmup")
            engines.append((name, llm, levels))
    vocab = engines[0][1].llm_engine.config.model_config.vocab_size
    rng = random.Random(0)  # the same prompts for every setting
    rows = []
    for c in args.concurrency:
        prompts = [[rng.randrange(256, vocab) for _ in range(args.input_len)] for _ in range(c)]
        for name, llm, levels in engines:
            if c in levels:
                rows.append({"setting": name, "concurrency": c,
                             **run_level(llm, prompts, args.output_len, f"{name}-{c}".replace(" ", "_"))})
                print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    del engines
    gc.collect()
    csv_path, png_path = args.output.with_suffix(".csv"), args.output.with_suffix(".png")
    write_csv(rows, FIELDS, csv_path)
    print(format_table(rows, args.concurrency, args.target_tpot_ms))
    plot(rows, png_path, args.target_tpot_ms, f"{args.input_len} in + {args.output_len} out\n{machine_header()}")
    print(f"wrote {csv_path} and {png_path}")


def format_table(rows: list[dict], levels: list[int], target_ms: float) -> str:
    """Markdown: the target's row at each level beside the fixed setting of most throughput there among those whose
    p99 TPOT holds the target (the issue's comparison; the default's run stands for every fixed setting of at least
    c), and beside the fastest fixed setting whatever its p99."""
    lines = ["| concurrent requests | target: total tok/s (p99 TPOT ms) | best fixed within the target: setting, total "
             "tok/s (p99 TPOT ms) | target / it | fastest fixed | target / it |", "|---|---|---|---|---|---|"]
    for c in levels:
        at_level = [r for r in rows if r["concurrency"] == c]
        target = next((r for r in at_level if r["setting"].startswith("target")), None)
        fixed = [r for r in at_level if r["setting"].startswith("fixed")]
        if target is None or not fixed:
            continue
        held = [r for r in fixed if r["p99_tpot_ms"] <= target_ms]
        within = compared(target, max(held, key=lambda r: r["total_tok_s"])) if held else "none | -"
        lines.append(f"| {c} | {target['total_tok_s']:.0f} ({target['p99_tpot_ms']:.1f}) | {within} | "
                     f"{compared(target, max(fixed, key=lambda r: r['total_tok_s']))} |")
    return "\n".join(lines)


def compared(target: dict, fixed: dict) -> str:
    """A fixed setting's cells: its name, total tok/s and p99 TPOT, and the target's throughput over its."""
    return (f"{fixed['setting']}: {fixed['total_tok_s']:.0f} ({fixed['p99_tpot_ms']:.1f}) | "
            f"{target['total_tok_s'] / fixed['total_tok_s']:.2f}")


def plot(rows: list[dict], path: Path, target_ms: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for setting in dict.fromkeys(r["setting"] for r in rows):
        points = sorted((r["concurrency"], r["total_tok_s"], r["p99_tpot_ms"]) for r in rows if r["setting"] == setting)
        style = {"linewidth": 2.5, "color": "black"} if setting.startswith("target") else {"alpha": 0.8}
        left.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=setting, **style)
        right.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=setting, **style)
    right.axhline(target_ms, linestyle="--", color="grey", label="target")
    for axis, label in ((left, "total tokens/s"), (right, "p99 time per output token (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    right.set_yscale("log")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
