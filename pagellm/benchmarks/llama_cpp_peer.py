"""llama.cpp as a benchmark peer, run in its own process (`python -m pagellm.benchmarks.llama_cpp_peer ...`).

A separate process because llama.cpp's OpenMP threads would otherwise share PyTorch's libgomp pool and its
spinning threads, which slowed llama.cpp by up to a third in our measurements. Imports nothing but
`llama_cpp`. Prints one JSON object: in latency mode the best prefill and decode seconds over the repeats, as
`llama-bench` measures them (the prompt in one batch, then one fixed token per step; no sampling); in throughput
mode the seconds to serve a list of requests batched together, as `llama-batched-bench` does.
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


def serve_batched(model: str, requests: list[tuple[list[int], int]], threads: int) -> dict[str, float]:
    """Every (prompt, output length) request as a sequence of one context, as `llama-batched-bench` runs them:
    the prompts decoded together in batches of up to 2048 tokens (logits for each prompt's last token), then one
    batch per step holding the next token of every sequence that still has output to produce (a fixed token: no
    sampling). Uses the binding's low-level batch API: its `Llama` class runs one sequence."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    llama_model = llama_cpp.llama_model_load_from_file(model.encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    # A KV stream per sequence (not one unified cache): each token attends over its own sequence's cells only.
    longest = max(len(prompt) + output_len for prompt, output_len in requests)
    params.n_ctx = len(requests) * (-(-longest // 256) * 256)
    params.n_batch, params.n_ubatch, params.n_seq_max, params.kv_unified = 2048, 512, len(requests), False
    params.n_threads = params.n_threads_batch = threads
    context = llama_cpp.llama_init_from_model(llama_model, params)
    batch = llama_cpp.llama_batch_init(2048, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
        for start in range(0, len(entries), 2048):
            chunk = entries[start:start + 2048]
            for i, (token, position, sequence, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
                batch.seq_id[i][0] = sequence
            batch.n_tokens = len(chunk)
            if llama_cpp.llama_decode(context, batch) != 0:
                raise RuntimeError("llama_decode failed")

    start = time.perf_counter()
    decode([(token, position, sequence, position == len(prompt) - 1)
            for sequence, (prompt, _) in enumerate(requests) for position, token in enumerate(prompt)])
    for step in range(max(output_len for _, output_len in requests) - 1):  # the first token came from the prompt
        decode([(prompt[step % len(prompt)], len(prompt) + step, sequence, True)
                for sequence, (prompt, output_len) in enumerate(requests) if step < output_len - 1])
    seconds = time.perf_counter() - start
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(context)
    llama_cpp.llama_model_free(llama_model)
    return {"seconds": seconds}


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
            print(json.dumps(serve_batched(args.model, [tuple(r) for r in json.load(f)], args.threads)))
        return
    prompt = [int(t) for t in args.prompt.split(",")]
    print(json.dumps(measure(args.model, prompt, args.output_len, args.repeats, args.threads)))


if __name__ == "__main__":
    main()
