"""llama.cpp as a benchmark peer, run in its own process (`python -m pagellm.benchmarks.llama_cpp_peer ...`).

A separate process because llama.cpp's OpenMP threads would otherwise share PyTorch's libgomp pool and its
spinning threads, which slowed llama.cpp by up to a third in our measurements. Imports nothing but
`llama_cpp`. Prints one JSON object: in latency mode the best prefill and decode seconds over the repeats, as
`llama-bench` measures them (the prompt in one batch, then one fixed token per step; no sampling), for one prompt or
for several decoded together (`--prompts`: a sequence each, as `llama-batched-bench`); in throughput mode the seconds
to serve a list of requests batched together, as `llama-batched-bench` does.
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


class BatchedContext:
    """A llama.cpp context with a KV stream per sequence (not one unified cache: each token attends over its own
    sequence's cells only), fed through the binding's low-level batch API (its `Llama` class runs one sequence)."""

    def __init__(self, llama_model, num_sequences: int, longest: int, threads: int) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = num_sequences * (-(-longest // 256) * 256)
        params.n_batch, params.n_ubatch, params.n_seq_max, params.kv_unified = 2048, 512, num_sequences, False
        params.n_threads = params.n_threads_batch = threads
        self.context = llama_cpp.llama_init_from_model(llama_model, params)
        self.batch = llama_cpp.llama_batch_init(2048, 0, 1)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, wants logits) entries, in batches of up to 2048 tokens."""
        batch = self.batch
        for start in range(0, len(entries), 2048):
            chunk = entries[start:start + 2048]
            for i, (token, position, sequence, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
                batch.seq_id[i][0] = sequence
            batch.n_tokens = len(chunk)
            if self._llama_cpp.llama_decode(self.context, batch) != 0:
                raise RuntimeError("llama_decode failed")

    def prefill(self, prompts: list[list[int]]) -> None:
        """Every prompt, logits for each one's last token."""
        self.decode([(token, position, sequence, position == len(prompt) - 1)
                     for sequence, prompt in enumerate(prompts) for position, token in enumerate(prompt)])

    def free(self) -> None:
        self._llama_cpp.llama_batch_free(self.batch)
        self._llama_cpp.llama_free(self.context)


def load_model(model: str):
    import llama_cpp

    llama_cpp.llama_backend_init()
    return llama_cpp.llama_model_load_from_file(model.encode(), llama_cpp.llama_model_default_params())


def measure_batched(model: str, prompts: list[list[int]], output_len: int, repeats: int,
                    threads: int) -> dict[str, float]:
    """`measure` for several prompts decoded together: the prompts in one batch, then `output_len` steps of one
    fixed token per sequence. A fresh context per repeat, so each starts from an empty cache."""
    import llama_cpp

    llama_model = load_model(model)
    prefill = decode = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        context = BatchedContext(llama_model, len(prompts), max(map(len, prompts)) + output_len + 8, threads)
        start = time.perf_counter()
        context.prefill(prompts)
        prefilled = time.perf_counter()
        for step in range(output_len):
            context.decode([(prompt[step % len(prompt)], len(prompt) + step, sequence, True)
                            for sequence, prompt in enumerate(prompts)])
        prefill = min(prefill, prefilled - start)
        decode = min(decode, time.perf_counter() - prefilled)
        context.free()
    llama_cpp.llama_model_free(llama_model)
    return {"prefill_seconds": prefill, "decode_seconds": decode}


def serve_batched(model: str, requests: list[tuple[list[int], int]], threads: int) -> dict[str, float]:
    """Every (prompt, output length) request as a sequence of one context, as `llama-batched-bench` runs them:
    the prompts decoded together in batches of up to 2048 tokens (logits for each prompt's last token), then one
    batch per step holding the next token of every sequence that still has output to produce (a fixed token: no
    sampling)."""
    import llama_cpp

    llama_model = load_model(model)
    context = BatchedContext(llama_model, len(requests), max(len(prompt) + n for prompt, n in requests), threads)
    start = time.perf_counter()
    context.prefill([prompt for prompt, _ in requests])
    for step in range(max(output_len for _, output_len in requests) - 1):  # the first token came from the prompt
        context.decode([(prompt[step % len(prompt)], len(prompt) + step, sequence, True)
                        for sequence, (prompt, output_len) in enumerate(requests) if step < output_len - 1])
    seconds = time.perf_counter() - start
    context.free()
    llama_cpp.llama_model_free(llama_model)
    return {"seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompt", help="comma-separated token ids (latency mode)")
    parser.add_argument("--prompts", help="JSON list of prompts (token id lists) decoded together (latency mode)")
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--requests", help="JSON list of [prompt token ids, output length] (throughput mode)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    if args.requests:
        with open(args.requests) as f:
            print(json.dumps(serve_batched(args.model, [tuple(r) for r in json.load(f)], args.threads)))
        return
    if args.prompts:
        with open(args.prompts) as f:
            print(json.dumps(measure_batched(args.model, json.load(f), args.output_len, args.repeats, args.threads)))
        return
    prompt = [int(t) for t in args.prompt.split(",")]
    print(json.dumps(measure(args.model, prompt, args.output_len, args.repeats, args.threads)))


if __name__ == "__main__":
    main()
