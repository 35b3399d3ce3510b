"""`pagellm bench throughput`: offline throughput on random-token prompts, beside Hugging Face transformers and
llama.cpp.

Each request gets a prompt of random token ids and a fixed number of output tokens (ignore_eos), lengths drawn
uniformly from the given ranges. Every backend runs the same requests with greedy decoding on the same threads;
`--backend hf` batches like vLLM's HF baseline (left padding, `generate` per batch with max_new_tokens = the
batch's longest output), in this process and dtype; `--backend llama.cpp` runs the GGUF file through
`llama-cpp-python` in a child process, every request a sequence of one batched context (`llama-batched-bench`'s
way), and `--llama-cpp-f32` gives it a float32 GGUF of the same weights instead.
Figures are tokens the requests asked for, never padding.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.benchmarks.machine import machine_header, model_flops, peak_matmul_flops


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class BenchResult:
    backend: str
    elapsed: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    def report(self, useful_flops: float, peak: float) -> str:
        total = self.prompt_tokens + self.output_tokens
        achieved = useful_flops / self.elapsed
        return (f"{self.backend:>12}: {self.elapsed:8.2f} s  {self.num_requests / self.elapsed:7.3f} req/s  "
                f"{self.output_tokens / self.elapsed:8.1f} output tok/s  {total / self.elapsed:8.1f} total tok/s  "
                f"{achieved / 1e9:7.1f} GFLOP/s = {100 * achieved / peak:5.1f}% of measured matmul peak")


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low, high = int(low), int(high or low)
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"invalid length range {text!r}: use N or MIN:MAX with 0 < MIN <= MAX")
    return low, high


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=parse_range, default=(32, 512), help="N or MIN:MAX prompt tokens")
    parser.add_argument("--output-len", type=parse_range, default=(32, 256), help="N or MIN:MAX output tokens")
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--backend", choices=["pagellm", "hf", "llama.cpp", "both", "all"], default="pagellm",
                        help="both: pagellm and hf; all: also llama.cpp (a GGUF model; requests batched)")
    parser.add_argument("--llama-cpp-f32", action="store_true",
                        help="llama.cpp runs a float32 GGUF of the same weights (written once with `gguf`)")
    parser.add_argument("--hf-max-batch-size", type=int, default=16)
    parser.add_argument("--hf-max-len", type=int, default=2048,
                        help="longest padded prompt + output of one HF generate call (as vLLM's HF baseline)")


def make_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    # Skip the low ids, where tokenizers keep their special tokens.
    return [BenchRequest([rng.randrange(256, vocab) for _ in range(rng.randint(*input_len))],
                         rng.randint(*output_len)) for _ in range(num)]


def run_pagellm(llm, requests: list[BenchRequest]) -> BenchResult:
    from pagellm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(r.output_len for r in requests), "pagellm produced a different number of tokens"
    return BenchResult("pagellm", elapsed, len(requests), sum(len(r.prompt_token_ids) for r in requests), produced)


def run_hf(model, requests: list[BenchRequest], pad_token_id: int, max_batch_size: int,
           max_len: int) -> BenchResult:
    from tqdm.auto import tqdm

    batches, batch = [], []
    for request in requests:
        candidate = batch + [request]
        padded = max(len(r.prompt_token_ids) for r in candidate) + max(r.output_len for r in candidate)
        if batch and (len(candidate) > max_batch_size or padded > max_len):
            batches.append(batch)
            candidate = [request]
        batch = candidate
    batches.append(batch)

    start = time.perf_counter()
    for batch in tqdm(batches, desc="HF batches"):
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            attention_mask[i, width - len(r.prompt_token_ids):] = 1
        max_new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                           do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                           pad_token_id=pad_token_id)
    elapsed = time.perf_counter() - start
    return BenchResult("transformers", elapsed, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                       sum(r.output_len for r in requests))


def run_llama_cpp(gguf_path: str, requests: list[BenchRequest], name: str = "llama.cpp") -> BenchResult:
    """llama.cpp through its Python binding, in a child process: one context serving the requests batched."""
    import json
    import subprocess
    import sys
    import tempfile

    from pagellm.benchmarks.llama_cpp_peer import require_binding

    require_binding()
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump([[r.prompt_token_ids, r.output_len] for r in requests], f)
        f.flush()
        command = [sys.executable, "-m", "pagellm.benchmarks.llama_cpp_peer", gguf_path, "--requests", f.name,
                   "--threads", str(torch.get_num_threads())]
        seconds = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)["seconds"]
    return BenchResult(name, seconds, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                       sum(r.output_len for r in requests))


def load_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def run(args: argparse.Namespace) -> None:
    from pagellm import LLM
    from pagellm.engine.arg_utils import EngineArgs

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    config = llm.llm_engine.config
    model_config, device = config.model_config, config.device_config.device
    requests = make_requests(args.num_prompts, args.input_len, args.output_len, model_config.vocab_size,
                             args.dataset_seed)
    useful_flops = sum(model_flops(model_config.hf_config, len(r.prompt_token_ids), r.output_len) for r in requests)
    peak = peak_matmul_flops(model_config.dtype, device)
    print(machine_header())
    print(f"{len(requests)} requests, input {args.input_len[0]}:{args.input_len[1]}, output "
          f"{args.output_len[0]}:{args.output_len[1]} tokens; {model_config.dtype}, {device}, "
          f"{torch.get_num_threads()} threads; measured matmul peak {peak / 1e9:.1f} GFLOP/s")

    if args.backend in ("llama.cpp", "all") and not model_config.gguf_file:
        raise SystemExit("the llama.cpp backend runs a GGUF model: pass --model FILE.gguf (or the default model)")
    results = []
    if args.backend in ("pagellm", "both", "all"):
        results.append(run_pagellm(llm, requests))
    if args.backend in ("llama.cpp", "all"):
        gguf_file, name = model_config.gguf_file, "llama.cpp"
        if args.llama_cpp_f32:
            from pagellm.benchmarks.latency_backends import f32_gguf

            gguf_file, name = str(f32_gguf(Path(gguf_file))), "llama.cpp F32"
        results.append(run_llama_cpp(gguf_file, requests, name))
    if args.backend in ("hf", "both", "all"):
        del llm  # free the KV pool before the baseline runs
        hf_model = load_hf_model(model_config.model, model_config.dtype, device)
        pad = model_config.hf_config.pad_token_id
        results.append(run_hf(hf_model, requests, pad if pad is not None else 0, args.hf_max_batch_size,
                              args.hf_max_len))
    print()
    for result in results:
        print(result.report(useful_flops, peak))
    ours = next((r for r in results if r.backend == "pagellm"), None)
    for theirs in results:
        if ours is not None and theirs is not ours:
            print(f"pagellm / {theirs.backend} total throughput: {theirs.elapsed / ours.elapsed:.2f}x")
