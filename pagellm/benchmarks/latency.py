"""`pagellm bench latency`: prefill and decode speed at fixed batch sizes, beside transformers and llama.cpp.

Every backend runs the same random-token prompts in this process on the same threads. Prefill tok/s is
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
import itertools
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagellm.benchmarks.latency_through import THROUGH, generate_seconds, running_server, server_seconds
from pagellm.benchmarks.llama_cpp_peer import require_binding
from pagellm.benchmarks.machine import (
    kv_bytes_per_token,
    machine_header,
    memory_bandwidth,
    model_flops,
    peak_matmul_flops,
)

LLAMA_CPP_KV_BYTES = 2  # llama.cpp's default KV cache type, F16 (the peer does not change it)

BACKENDS = ("pagellm", "hf", "llama.cpp", "llama.cpp-f32")
# First-token shifts of the engine-step runs, counted across calls: a second call on the same engine (the base model
# again after a LoRA run) must not find its prompts in the prefix cache. Below latency_through.GENERATE_SHIFTS.
_STEP_RUNS = itertools.count(1)


@dataclass
class LatencyResult:
    backend: str
    batch_size: int
    prefill_tok_s: float
    decode_tok_s: float
    weight_bytes: int  # bytes streamed per decode step (the weights, as that backend stores them)
    kv_bytes_per_token: int  # bytes of K/V per cached token, as that backend stores them


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


def _best_of(repeats: int, run: Callable[[int], float], output_len: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds), each the best of `repeats`: run(n) generates n tokens."""
    prefill = min(run(1) for _ in range(repeats))
    total = min(run(1 + output_len) for _ in range(repeats))
    if total <= prefill:
        raise SystemExit(f"decoding {output_len} tokens took no measurable time next to the noise of the prefill "
                         f"({total:.4f} s vs {prefill:.4f} s); raise --output-len")
    return prefill, total - prefill


def bench_pagellm(llm, prompts: list[list[int]], output_len: int, repeats: int, step_split: bool,
                  loras: list | None = None) -> LatencyResult:
    """Drives the engine step by step, so decode is timed on decode-only steps: a long prompt's prefill runs in
    chunks over several steps, and the steps that mix the last chunks with early sequences' decodes belong to
    neither figure cleanly (subtracting a 1-token run from a longer one charged them, and their noise, to decode)."""
    from pagellm import SamplingParams

    engine = llm.llm_engine
    vocab = engine.config.model_config.vocab_size
    runs = _STEP_RUNS

    def run(n: int) -> tuple[float, float, int]:
        """Generate n tokens per prompt: (seconds until every prompt has its first token, seconds of the steps
        after that, tokens those steps generated)."""
        # A new first token each run: block hashes chain, so the prefix cache holds nothing of the prompts and
        # every run pays its whole prefill, as the other backends do.
        shift = next(runs)
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            prompt = {"prompt_token_ids": [(p[0] + shift) % vocab, *p[1:]]}
            if loras:
                prompt["lora_request"] = loras[i % len(loras)]
            engine.add_request(f"latency-{shift}-{i}", prompt, params)
        started: set[str] = set()
        first_tokens = decode = 0.0
        decode_tokens = 0
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs, generated = engine.step_outputs()
            if len(started) == len(prompts):
                decode += time.perf_counter() - step_start
                decode_tokens += generated
                continue
            started.update(o.request_id for o in outputs)
            if len(started) == len(prompts):
                first_tokens = time.perf_counter() - start
        return first_tokens, decode, decode_tokens

    run(2)  # warm-up: kernels built, caches touched
    measured = [run(1 + output_len) for _ in range(repeats)]
    prefill = min(first_tokens for first_tokens, _, _ in measured)
    decode_tok_s = max(tokens / seconds for _, seconds, tokens in measured)
    if step_split:
        timings = engine.engine_core.step_timings
        timings.reset()
        run(1 + output_len)
        print(f"  pagellm step split, batch {len(prompts)} (prefill step included): {timings.report()}")
    model_config = engine.config.model_config
    weight_bytes = engine.engine_core.executor.collective_rpc("weight_bytes")[0]
    kv_dtype = engine.config.cache_config.kv_dtype(model_config.dtype)
    return _result("pagellm + LoRA" if loras else "pagellm", prompts, prefill, decode_tok_s, weight_bytes,
                   kv_bytes_per_token(model_config.hf_config, kv_dtype.itemsize))


def bench_hf(model, prompts: list[list[int]], output_len: int, repeats: int) -> LatencyResult:
    input_ids = torch.tensor(prompts, device=model.device)

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(2)
    prefill, decode = _best_of(repeats, run, output_len)
    weight_bytes = sum(p.nbytes for p in model.parameters() if p.dim() == 2)
    return _result("transformers", prompts, prefill, len(prompts) * output_len / decode, weight_bytes,
                   kv_bytes_per_token(model.config, model.dtype.itemsize))


def bench_llama_cpp(name: str, gguf_path: Path, prompts: list[list[int]], output_len: int, repeats: int,
                    hf_config) -> LatencyResult:
    import gguf

    require_binding()
    with tempfile.TemporaryDirectory() as tmp:
        if len(prompts) == 1:
            given = ["--prompt", ",".join(map(str, prompts[0]))]
        else:  # too long for a command line
            given = ["--prompts", str(Path(tmp) / "prompts.json")]
            Path(given[1]).write_text(json.dumps(prompts))
        command = [sys.executable, "-m", "pagellm.benchmarks.llama_cpp_peer", str(gguf_path), *given,
                   "--output-len", str(output_len), "--repeats", str(repeats), "--threads",
                   str(torch.get_num_threads())]
        seconds = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    weight_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors if len(t.shape) == 2)
    return _result(name, prompts, seconds["prefill_seconds"], len(prompts) * output_len / seconds["decode_seconds"],
                   weight_bytes, kv_bytes_per_token(hf_config, LLAMA_CPP_KV_BYTES))


def _result(backend: str, prompts: list[list[int]], prefill: float, decode_tok_s: float, weight_bytes: int,
            kv_bytes: int) -> LatencyResult:
    batch = len(prompts)
    return LatencyResult(backend, batch, batch * len(prompts[0]) / prefill, decode_tok_s, weight_bytes, kv_bytes)


def decode_step_bytes(result: LatencyResult, input_len: int, output_len: int) -> float:
    """Bytes a decode step reads at least: the weights once, and each sequence's cached K/V at the mean context of
    the decode steps (the step computing token input_len + j attends to input_len + j of them, j = 1..output_len)."""
    mean_context = input_len + (output_len + 1) / 2
    return result.weight_bytes + result.batch_size * mean_context * result.kv_bytes_per_token


def f32_gguf(source: Path) -> Path:
    """A float32 GGUF of `source`'s weights, written once into the cache directory: llama.cpp's float32 peer."""
    from pagellm.envs import cache_root

    return write_f32_gguf(source, cache_root() / "gguf" / f"{source.stem}.F32.gguf")


def write_f32_gguf(source: Path, target: Path) -> Path:
    """The same model with every tensor dequantized to float32 (as `llama-quantize ... F32`), via `gguf`."""
    import gguf

    if target.is_file():
        return target
    reader = gguf.GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # written by the writer itself
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        writer.add_tensor(tensor.name, np.ascontiguousarray(values, dtype=np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


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
                results.append(_result("pagellm generate()", prompts, prefill, batch * args.output_len / decode,
                                       step.weight_bytes, step.kv_bytes_per_token))
            if server is not None:
                prefill, decode, tpot = server_seconds(server, model_config.served_model_name, prompts,
                                                       args.output_len, args.repeats, model_config.vocab_size)
                results.append(_result("pagellm server", prompts, prefill, batch * args.output_len / decode,
                                       step.weight_bytes, step.kv_bytes_per_token))
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
