"""llama.cpp as a benchmark peer, run in its own process (`python -m pagellm.benchmarks.llama_cpp_peer ...`).

A separate process because llama.cpp's OpenMP threads would otherwise share PyTorch's libgomp pool and its
spinning threads, which slowed llama.cpp by up to a third in our measurements. Imports nothing but
`llama_cpp`. Prints one JSON object: the best prefill and decode seconds over the repeats, as `llama-bench`
measures them (the prompt in one batch, then one fixed token per step; no sampling).
"""
from __future__ import annotations

import argparse
import json
import time


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompt", required=True, help="comma-separated token ids")
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    prompt = [int(t) for t in args.prompt.split(",")]
    print(json.dumps(measure(args.model, prompt, args.output_len, args.repeats, args.threads)))


if __name__ == "__main__":
    main()
