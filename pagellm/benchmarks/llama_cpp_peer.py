"""llama.cpp as a benchmark peer, run in its own process (`python -m pagellm.benchmarks.llama_cpp_peer ...`).

A separate process because llama.cpp's OpenMP threads would otherwise share PyTorch's libgomp pool and its
spinning threads, which slowed llama.cpp by up to a third in our measurements. Imports nothing but
`llama_cpp`. Prints one JSON object: in latency mode the best prefill and decode seconds over the repeats, as
`llama-bench` measures them (the prompt in one batch, then one fixed token per step; no sampling); in throughput
mode the seconds to serve a list of requests one after another.
"""
from __future__ import annotations

import argparse
import json
import time


def require_binding() -> None:
    """Fail early, in the parent process, with what to install."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise SystemExit("The llama.cpp backend needs the `llama-cpp-python` package (it builds llama.cpp from "
                         "source, ~15-20 min on 2 cores): pip install 'pagellm[llamacpp]'.") from exc


def measure(model: str, prompt: list[int], output_len: int, repeats: int, threads: int) -> dict[str, float]:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=len(prompt) + output_len + 8, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    prefill = decode = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefilled = time.perf_counter()
        for i in range(output_len):
            llm.eval([prompt[i % len(prompt)]])
        prefill = min(prefill, prefilled - start)
        decode = min(decode, time.perf_counter() - prefilled)
    return {"prefill_seconds": prefill, "decode_seconds": decode}


def serve_sequentially(model: str, requests: list[tuple[list[int], int]], threads: int) -> dict[str, float]:
    """Every (prompt, output length) request in turn on one context, as one llama.cpp context per sequence
    would: the prompt in one batch, then one fixed token per step."""
    from llama_cpp import Llama

    longest = max(len(prompt) + output_len for prompt, output_len in requests)
    llm = Llama(model_path=model, n_ctx=longest + 8, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    start = time.perf_counter()
    for prompt, output_len in requests:
        llm.reset()
        llm.eval(prompt)
        for i in range(output_len - 1):  # the first output token comes from the prompt's logits
            llm.eval([prompt[i % len(prompt)]])
    return {"seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompt", help="comma-separated token ids (latency mode)")
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--requests", help="JSON list of [prompt token ids, output length] (throughput mode)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    if args.requests:
        with open(args.requests) as f:
            print(json.dumps(serve_sequentially(args.model, [tuple(r) for r in json.load(f)], args.threads)))
        return
    prompt = [int(t) for t in args.prompt.split(",")]
    print(json.dumps(measure(args.model, prompt, args.output_len, args.repeats, args.threads)))


if __name__ == "__main__":
    main()
