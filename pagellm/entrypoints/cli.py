"""The `pagellm` command: `generate` (one prompt, printed), `serve` (OpenAI-compatible server), `run-batch` (an
OpenAI batch file), and the benchmarks
`bench throughput`, `bench latency`, `bench sweep`, `bench accuracy`, `bench serve`, `bench soak`, `bench sharing`,
`bench prefix`, `bench memory`, `bench control`, `bench structured`, `bench embed`, `bench spec`."""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pagellm.engine.arg_utils import EngineArgs
from pagellm.sampling_params import SamplingParams


def _generate(args: argparse.Namespace) -> int:
    from pagellm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    completion = output.outputs[0]
    print(completion.text if args.chat else args.prompt + completion.text)
    print(f"[{len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
          f"finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pagellm.entrypoints.openai.api_server import run_server

    return run_server(args)


# Benchmarks that run an engine in this process: name -> help. Each module pagellm.benchmarks.<name> has
# add_cli_args(parser) and run(args), and takes the engine flags.
_ENGINE_BENCHMARKS = {
    "throughput": "offline throughput, optionally against transformers and llama.cpp",
    "latency": "prefill and decode tok/s at fixed batch sizes, beside transformers and llama.cpp",
    "sweep": "throughput and time per output token against concurrency, to CSV and PNG",
    "accuracy": "perplexity and greedy agreement of --quantization against float32",
    "sharing": "KV blocks saved by sharing for n > 1 and beam search",
    "prefix": "prefix caching on vs off: a shared system prompt and a chat replay (tok/s, TTFT, hit rate)",
    "memory": "a small KV pool: recompute vs swap preemption, outputs compared, KV token efficiency",
    "control": "per-step cost of the worker boundary: transport, and uni vs mp executors",
    "structured": "JSON-schema constrained decoding: time per output token vs unconstrained, first-request "
                  "latency with compilation, validity of sampled objects",
    "embed": "embedding throughput (inputs/s, tokens/s) of LLM.embed beside transformers' batched inference",
    "spec": "batch-1 decode tok/s with ngram, suffix (and --draft-model) speculative decoding vs without, editing and "
            "chat workloads",
}


def _run_engine_benchmark(args: argparse.Namespace) -> int:
    importlib.import_module(f"pagellm.benchmarks.{args.bench_command}").run(args)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from pagellm.benchmarks.serve import run

    try:
        run(args)
    except ConnectionError as exc:  # an unreachable server: one line naming the URL, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _bench_soak(args: argparse.Namespace) -> int:
    from pagellm.benchmarks.soak import run

    try:
        return run(args)
    except ConnectionError as exc:  # an unreachable server: one line naming the URL, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1


# Benchmarks with flags of their own and no engine: name -> (module, help, handler).
_OTHER_BENCHMARKS = {
    "random-gguf": ("random_gguf", "write a random-weight GGUF of a real model's shapes in a llama.cpp quantization "
                    "mix (for bench latency --model)", None),
    "random-checkpoint": ("random_checkpoint", "write a random-weight Hugging Face Llama checkpoint of a real "
                          "model's shapes (for bench latency --model on a GPU)", None),
    "serve": ("serve", "load-test an OpenAI-compatible server over HTTP (no engine flags)", _bench_serve),
    "soak": ("soak", "mixed, partly bad or abandoned traffic against a running server, then check that it drains "
             "(no engine flags)", _bench_soak),
}


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The command line that parses `argv`. A benchmark's flags (and module) are added only when `argv` runs it
    (`bench NAME ...`), so `serve`, `generate` and `--help` import no benchmark."""
    selected = argv[1] if len(argv) > 1 and argv[0] == "bench" else None
    parser = argparse.ArgumentParser(prog="pagellm", description="Run and serve large language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt and print the result")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    generate.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    generate.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(handler=_generate)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    from pagellm.entrypoints.openai.cli_args import make_arg_parser

    make_arg_parser(serve)
    serve.set_defaults(handler=_serve)

    run_batch = commands.add_parser("run-batch", help="run an OpenAI batch file (JSONL) through the server's endpoints")
    if argv[:1] == ["run-batch"]:  # its module (and the server's) imported only when it runs
        batch_module = importlib.import_module("pagellm.entrypoints.run_batch")
        batch_module.add_cli_args(run_batch)
        run_batch.set_defaults(handler=batch_module.run_batch)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for name, help_text in _ENGINE_BENCHMARKS.items():
        benchmark = bench.add_parser(name, help=help_text)
        if name == selected:
            importlib.import_module(f"pagellm.benchmarks.{name}").add_cli_args(benchmark)
            EngineArgs.add_cli_args(benchmark)
            benchmark.set_defaults(handler=_run_engine_benchmark)
    for name, (module_name, help_text, handler) in _OTHER_BENCHMARKS.items():
        benchmark = bench.add_parser(name, help=help_text)
        if name == selected:
            module = importlib.import_module(f"pagellm.benchmarks.{module_name}")
            module.add_cli_args(benchmark)
            benchmark.set_defaults(handler=handler or module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
