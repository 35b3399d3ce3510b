"""`pagellm bench spec`: batch-1 decode speed with speculative decoding (each of `--methods`: `ngram` prompt lookup,
`suffix` decoding) against without, in one run, on two workloads through the chat template, greedy (so every setting
emits the same tokens):

- editing: the prompt holds a code block (a class of pagellm's own source) and asks for it back with one change,
  so the answer repeats much of the prompt: the case both drafters are for;
- chat: open questions, whose answers repeat little.

Per workload and setting: decode tok/s (output tokens after the first, over the time from the first token to the
last), and with speculation the acceptance rate (accepted over drafted tokens) and the mean tokens per step of a
speculating request. The outputs are compared token for token with those without speculation.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import itertools
import json
import time
from pathlib import Path

from pagellm.benchmarks.machine import machine_header
from pagellm.config import SpeculativeConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode import ngram_proposer

_request_ids = itertools.count()
BENCH_METHODS = ("ngram", "suffix")  # the model-free drafters
CHAT_QUESTIONS = ("Explain in a few paragraphs how a bicycle stays upright.",
                  "Write a short story about a lighthouse keeper who finds a message in a bottle.")


def editing_prompts() -> list[str]:
    source = inspect.getsource(ngram_proposer.NgramProposer)
    return [f"Here is a Python class:\n\n```python\n{source}```\n\nRewrite it with `min_n` renamed to `shortest`. "
            f"Reply with the whole class in a code block and nothing else.",
            f"Here is a Python class:\n\n```python\n{source}```\n\nRepeat the class exactly, adding a one-line "
            f"comment above `propose`. Reply with the whole class in a code block."]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-len", type=int, default=256, help="most tokens generated per prompt")
    parser.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens,
                        help="k: the most tokens a request drafts")
    parser.add_argument("--methods", nargs="+", choices=BENCH_METHODS, default=list(BENCH_METHODS),
                        help="speculative methods to run beside no speculation")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def decode_one(engine: LLMEngine, prompt: list[int], output_len: int) -> tuple[list[int], float]:
    """Generate for one prompt alone; returns its tokens and the seconds from its first token to its last."""
    engine.add_request(str(next(_request_ids)), {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=output_len))
    first = last = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        outputs, _ = engine.step_outputs()
        now = time.perf_counter()
        for output in outputs:
            first = first or now
            last = now
            if output.finished:
                tokens = list(output.outputs[0].token_ids)
    return tokens, (last or 0.0) - (first or 0.0)


def run_setting(engine_args: EngineArgs, spec: dict | None, workloads: dict[str, list[str]],
                output_len: int) -> dict:
    engine = LLMEngine.from_engine_args(dataclasses.replace(engine_args, speculative_config=spec))
    tokenizer = engine.tokenizer

    def encode(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)

    decode_one(engine, encode("Hello."), 8)  # warm-up: kernels built, first-use costs paid
    scheduler = engine.engine_core.scheduler
    results = {}
    for name, texts in workloads.items():
        before = dataclasses.replace(scheduler.spec_decoding_stats)
        outputs, seconds = [], 0.0
        for text in texts:
            tokens, elapsed = decode_one(engine, encode(text), output_len)
            outputs.append(tokens)
            seconds += elapsed
        after = scheduler.spec_decoding_stats
        drafted = after.num_draft_tokens - before.num_draft_tokens
        drafts = after.num_drafts - before.num_drafts
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        decoded = sum(len(t) - 1 for t in outputs)
        results[name] = {"decode_tok_s": decoded / seconds, "output_tokens": sum(map(len, outputs)),
                         "acceptance_rate": accepted / drafted if drafted else None,
                         "tokens_per_verify_step": (accepted + drafts) / drafts if drafts else None,
                         "outputs": outputs}
    engine.shutdown()
    return results


def run(args: argparse.Namespace) -> dict:
    if args.output_len < 2 or args.num_speculative_tokens < 1:
        raise ValueError("--output-len must be >= 2 and --num-speculative-tokens >= 1")
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), max_num_seqs=1)
    workloads = {"editing": editing_prompts(), "chat": list(CHAT_QUESTIONS)}
    off = run_setting(engine_args, None, workloads, args.output_len)
    on = {}
    for method in args.methods:
        gc.collect()  # free the last engine's KV pool before the next one allocates its own
        on[method] = run_setting(engine_args, {"method": method, "num_speculative_tokens": args.num_speculative_tokens},
                                 workloads, args.output_len)
    print(machine_header())
    print(f"batch-1 greedy decode, k={args.num_speculative_tokens}, up to {args.output_len} tokens per prompt")
    print(f"  {'workload':<10}{'method':<8}{'off tok/s':>11}{'on tok/s':>10}{'speedup':>9}{'accepted':>10}"
          f"{'tok/step':>10}{'same tokens':>13}")
    report: dict = {}
    for name in workloads:
        a = off[name]
        report[name] = {"off": {k: v for k, v in a.items() if k != "outputs"}}
        for method, results in on.items():
            b = results[name]
            rate, per_step = b["acceptance_rate"], b["tokens_per_verify_step"]
            same = a["outputs"] == b["outputs"]
            speedup = b["decode_tok_s"] / a["decode_tok_s"]
            print(f"  {name:<10}{method:<8}{a['decode_tok_s']:>11.1f}{b['decode_tok_s']:>10.1f}{speedup:>8.2f}x"
                  f"{'-' if rate is None else f'{100 * rate:.0f}%':>10}"
                  f"{'-' if per_step is None else f'{per_step:.2f}':>10}{str(same):>13}")
            report[name][method] = {"on": {k: v for k, v in b.items() if k != "outputs"}, "speedup": speedup,
                                    "same_tokens": same}
    if args.json:
        Path(args.json).write_text(json.dumps({"config": {"output_len": args.output_len, "methods": args.methods,
                                                          "num_speculative_tokens": args.num_speculative_tokens},
                                               **report}, indent=2))
    return report
