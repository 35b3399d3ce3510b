"""The figures of `pagellm bench latency` (and `bench sweep`), one backend at a time: pagellm driven step by step,
transformers' `generate`, and llama.cpp in a child process (llama_cpp_peer.py) on the GGUF file or on a float32
copy written here (`f32_gguf`). Each returns a LatencyResult: prefill and decode tok/s, and the bytes a decode step
must read (weights, K/V per cached token) as that backend stores them, for the rooflines."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagellm.benchmarks.llama_cpp_peer import require_binding
from pagellm.benchmarks.machine import kv_bytes_per_token

LLAMA_CPP_KV_BYTES = 2  # llama.cpp's default KV cache type, F16 (the peer does not change it)
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

    @classmethod
    def measured(cls, backend: str, prompts: list[list[int]], prefill: float, decode_tok_s: float, weight_bytes: int,
                 kv_bytes: int) -> LatencyResult:
        """From a run of these prompts: prefill tok/s is every prompt's tokens over `prefill` seconds."""
        batch = len(prompts)
        return cls(backend, batch, batch * len(prompts[0]) / prefill, decode_tok_s, weight_bytes, kv_bytes)


def decode_step_bytes(result: LatencyResult, input_len: int, output_len: int) -> float:
    """Bytes a decode step reads at least: the weights once, and each sequence's cached K/V at the mean context of
    the decode steps (the step computing token input_len + j attends to input_len + j of them, j = 1..output_len)."""
    mean_context = input_len + (output_len + 1) / 2
    return result.weight_bytes + result.batch_size * mean_context * result.kv_bytes_per_token


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
    return LatencyResult.measured("pagellm + LoRA" if loras else "pagellm", prompts, prefill, decode_tok_s,
                                  weight_bytes, kv_bytes_per_token(model_config.hf_config, kv_dtype.itemsize))


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
    return LatencyResult.measured("transformers", prompts, prefill, len(prompts) * output_len / decode, weight_bytes,
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
    return LatencyResult.measured(name, prompts, seconds["prefill_seconds"],
                                  len(prompts) * output_len / seconds["decode_seconds"], weight_bytes,
                                  kv_bytes_per_token(hf_config, LLAMA_CPP_KV_BYTES))


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
