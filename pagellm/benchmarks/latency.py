"""`pagellm bench latency`: prefill and decode speed at fixed batch sizes, beside transformers and llama.cpp.

Every backend runs the same random-token prompts in this process on the same threads (each backend's run:
latency_backends.py; this module holds the command's flags, its runs and the table). Prefill tok/s is
batch x input_len over the time until every prompt has its first token; decode tok/s is the tokens of the remaining
steps over their time (pagellm: its decode-only steps, timed one by one; the other backends, which prefill a batch
in one call: generation of 1 + output_len tokens minus generation of 1). llama.cpp runs through the
`llama-cpp-python` binding on the GGUF file itself, in a child process of its own (`llama_cpp_peer`: at batch 1 as
`llama-bench`, at batch N as `llama-batched-bench`, a KV stream per sequence; fixed tokens fed back, no sampling),
and at float32 on an F32 GGUF written here with the `gguf` package from the same weights.
`--lora-rank R` (or the engine's `--lora-modules`) times pagellm's steps again with LoRA adapters (random ones of rank
R on every projection, `--num-loras` of them, written here), the batch's prompts taking them in turn.
`--through generate,server` times pagellm also where users meet it: `LLM.generate()` and the OpenAI server's streams
(latency_through.py), each printed against the engine's steps.
Each figure is also printed against the machine's own limits, measured here: the memory bandwidth bounds
decode (every weight byte is read once per step, and every sequence's cached K/V, as that backend stores them: at
the mean context of the decode steps) and the matmul peak bounds prefill.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
from pathlib import Path

import torch

from pagellm.benchmarks.latency_backends import (
    LatencyResult,
    bench_hf,
    bench_llama_cpp,
    bench_pagellm,
    decode_step_bytes,
    f32_gguf,
)
from pagellm.benchmarks.latency_through import THROUGH, generate_seconds, running_server, server_seconds
from pagellm.benchmarks.machine import machine_header, memory_bandwidth, model_flops, peak_matmul_flops

BACKENDS = ("pagellm", "hf", "llama.cpp", "llama.cpp-f32")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch-size", type=lambda s: [int(b) for b in s.split(",")], default=[1],
                        help="comma-separated batch sizes")
    parser.add_argument("--backends", type=lambda s: s.split(","), default=["pagellm"],
                        help=f"comma-separated, from {', '.join(BACKENDS)}")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per figure")
    parser.add_argument("--through", type=lambda s: s.split(","), default=["step"],
                        help=f"comma-separated, from {', '.join(THROUGH)}: where pagellm is timed: its engine steps, "
                             f"LLM.generate(), or the OpenAI server's streams (a child process)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="also time pagellm's steps with random LoRA adapters of this rank on every projection")
    parser.add_argument("--num-loras", type=int, default=1,
                        help="how many adapters (random, or --lora-modules') the batch's prompts take in turn")
    parser.add_argument("--step-split", action="store_true",
                        help="print where pagellm's decode step time goes (schedule, inputs, forward, sample, ...)")


def run(args: argparse.Namespace) -> None:
    from pagellm.engine.arg_utils import EngineArgs

    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"unknown backend(s) {', '.join(sorted(unknown))}; choose from {', '.join(BACKENDS)}")
    if set(args.through) - set(THROUGH):
        raise SystemExit(f"unknown --through {', '.join(sorted(set(args.through) - set(THROUGH)))}; choose from "
                         f"{', '.join(THROUGH)}")
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(running_server(EngineArgs.from_cli_args(args))) if "server" in args.through \
            else None
        _run(args, server)


def _run(args: argparse.Namespace, server: str | None) -> None:
    from pagellm import LLM
    from pagellm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    if args.lora_rank or engine_args.lora_modules:
        engine_args.enable_lora = True
        engine_args.max_loras = max(engine_args.max_loras, args.num_loras, len(engine_args.lora_modules or []))
        engine_args.max_lora_rank = max(engine_args.max_lora_rank, args.lora_rank)
    llm = LLM(**vars(engine_args))
    loras = _lora_requests(llm, args)
    model_config = llm.llm_engine.config.model_config
    device = llm.llm_engine.config.device_config.device
    rng = random.Random(0)
    bandwidth = memory_bandwidth(device)
    peak = peak_matmul_flops(model_config.dtype, device)
    print(machine_header())
    print(f"{model_config.served_model_name}: input {args.input_len}, output {args.output_len} tokens, "
          f"{torch.get_num_threads()} threads, {device}; quantization {model_config.quantization}"
          f"{' + int8 activations' if model_config.quantize_activations else ''}, "
          f"KV cache {str(llm.llm_engine.config.cache_config.kv_dtype(model_config.dtype)).removeprefix('torch.')}"
          f"{'; async scheduling' if llm.llm_engine.config.scheduler_config.async_scheduling else ''}. "
          f"Machine: {bandwidth / 1e9:.1f} GB/s memory read, {peak / 1e9:.0f} GFLOP/s "
          f"{str(model_config.dtype).removeprefix('torch.')} matmul peak.")
    results: list[LatencyResult] = []
    for batch in args.batch_size:
        prompts = [[rng.randrange(256, model_config.vocab_size) for _ in range(args.input_len)]
                   for _ in range(batch)]
        if "pagellm" in args.backends:
            results.append(bench_pagellm(llm, prompts, args.output_len, args.repeats, args.step_split))
            step = results[-1]
            if loras:  # between two runs of the base model, whose best is kept: the host's load drifts
                results.append(bench_pagellm(llm, prompts, args.output_len, args.repeats, args.step_split, loras))
                again = bench_pagellm(llm, prompts, args.output_len, args.repeats, False)
                if again.decode_tok_s > step.decode_tok_s:
                    results[-2] = step = again
                print(f"  pagellm + {len(loras)} LoRA adapter(s), batch {batch}: time per decode token "
                      f"{step.decode_tok_s / results[-1].decode_tok_s:.3f}x, prefill "
                      f"{step.prefill_tok_s / results[-1].prefill_tok_s:.3f}x the base model's")
            if "generate" in args.through:
                prefill, decode = generate_seconds(llm, prompts, args.output_len, args.repeats)
                results.append(LatencyResult.measured("pagellm generate()", prompts, prefill,
                                                      batch * args.output_len / decode, step.weight_bytes,
                                                      step.kv_bytes_per_token))
            if server is not None:
                prefill, decode, tpot = server_seconds(server, model_config.served_model_name, prompts,
                                                       args.output_len, args.repeats, model_config.vocab_size)
                results.append(LatencyResult.measured("pagellm server", prompts, prefill,
                                                      batch * args.output_len / decode, step.weight_bytes,
                                                      step.kv_bytes_per_token))
                print(f"  pagellm server, batch {batch}: mean time between a stream's tokens (TPOT) "
                      f"{1e3 * tpot:.2f} ms")
        if "hf" in args.backends:
            from pagellm.benchmarks.throughput import load_hf_model

            results.append(bench_hf(load_hf_model(model_config.model, model_config.dtype, device), prompts,
                                    args.output_len, args.repeats))
        if model_config.gguf_file:
            source = Path(model_config.gguf_file)
            if "llama.cpp" in args.backends:
                results.append(bench_llama_cpp("llama.cpp", source, prompts, args.output_len, args.repeats,
                                               model_config.hf_config))
            if "llama.cpp-f32" in args.backends:
                f32 = f32_gguf(source)
                results.append(bench_llama_cpp("llama.cpp F32", f32, prompts, args.output_len, args.repeats,
                                               model_config.hf_config))
    flops_per_token = model_flops(model_config.hf_config, args.input_len, 1) / args.input_len
    print(f"\n{'backend':>16} {'batch':>5} {'prefill tok/s':>14} {'% of peak':>9} {'decode tok/s':>13} "
          f"{'weights MB':>10} {'KV MB/step':>10} {'% of bandwidth':>14}")
    for r in results:
        step_bytes = decode_step_bytes(r, args.input_len, args.output_len)
        decode_limit = r.batch_size * bandwidth / step_bytes
        print(f"{r.backend:>16} {r.batch_size:>5} {r.prefill_tok_s:>14.1f} "
              f"{100 * r.prefill_tok_s * flops_per_token / peak:>8.1f}% {r.decode_tok_s:>13.1f} "
              f"{r.weight_bytes / 1e6:>10.1f} {(step_bytes - r.weight_bytes) / 1e6:>10.1f} "
              f"{100 * r.decode_tok_s / decode_limit:>13.1f}%")
    base = {r.batch_size: r for r in results if r.backend == "pagellm"}
    for r in results:
        if r.backend == "pagellm + LoRA":  # its ratio to the base model is printed beside its run
            continue
        if r.backend.startswith("pagellm ") and r.batch_size in base:
            print(f"{r.backend} / pagellm steps at batch {r.batch_size}: decode "
                  f"{r.decode_tok_s / base[r.batch_size].decode_tok_s:.3f}x (the work around the steps: "
                  f"{100 * (base[r.batch_size].decode_tok_s / r.decode_tok_s - 1):.1f}% of their time)")
        elif r.backend != "pagellm" and r.batch_size in base:
            ours = base[r.batch_size]
            print(f"pagellm / {r.backend} at batch {r.batch_size}: prefill {ours.prefill_tok_s / r.prefill_tok_s:.2f}x,"
                  f" decode {ours.decode_tok_s / r.decode_tok_s:.2f}x")


def _lora_requests(llm, args: argparse.Namespace) -> list:
    """The adapters the LoRA runs take in turn: --lora-modules', or `--num-loras` random ones of `--lora-rank`."""
    from pagellm.lora import LoRARequest
    from pagellm.lora.peft import write_random_adapter

    loras = llm.llm_engine.input_processor.loras
    if loras is not None and loras.named():
        return loras.named()[:args.num_loras]
    if not args.lora_rank:
        return []
    hf_config = llm.llm_engine.config.model_config.hf_config
    directory = tempfile.mkdtemp(prefix="pagellm-bench-lora-")
    return [LoRARequest(f"random-{i}", i + 1, write_random_adapter(f"{directory}/{i}", hf_config, args.lora_rank, i))
            for i in range(args.num_loras)]
