"""`pagellm bench accuracy`: what a weight format costs in accuracy, against float32 on the same checkpoint.

Loads the model twice, with `--quantization none` and with the format asked for, and compares (1) the perplexity of
a text (prompt logprobs of every token) and the mean and largest per-token logprob difference, and (2) greedy
continuations of a few prompts: tokens identical, and where each first diverges.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

PROMPTS = ["The history of", "def fibonacci(n):", "Paris is", "In 1969,", "The best way to learn", "Water boils at",
           "Once upon a time", "import numpy as np"]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", type=Path, default=Path("README.md"), help="text whose perplexity is compared")
    parser.add_argument("--max-text-tokens", type=int, default=2000)
    parser.add_argument("--greedy-tokens", type=int, default=64)


def _measure(llm, text: str, max_tokens: int, greedy_tokens: int) -> tuple[list[float], list[list[int]]]:
    from pagellm import SamplingParams

    ids = llm.get_tokenizer()(text)["input_ids"][:max_tokens]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [entry[token].logprob for entry, token in zip(out[0].prompt_logprobs[1:], ids[1:])]
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=greedy_tokens, ignore_eos=True),
                          use_tqdm=False)
    return logprobs, [g.outputs[0].token_ids for g in greedy]


def run(args: argparse.Namespace) -> None:
    from pagellm import LLM
    from pagellm.engine.arg_utils import EngineArgs

    engine_args = vars(EngineArgs.from_cli_args(args))
    text = args.text.read_text(encoding="utf-8")
    results = {}
    for quantization in ("none", args.quantization or "none"):
        llm = LLM(**{**engine_args, "quantization": quantization})
        results[quantization] = _measure(llm, text, args.max_text_tokens, args.greedy_tokens)
        del llm
    (base, base_greedy), (other, other_greedy) = results["none"], results[args.quantization or "none"]
    deltas = [abs(a - b) for a, b in zip(base, other)]
    same = sum(a == b for x, y in zip(base_greedy, other_greedy) for a, b in zip(x, y))
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(base_greedy, other_greedy)]
    print(f"perplexity over {len(base)} tokens of {args.text}: float32 {math.exp(-sum(base) / len(base)):.3f}, "
          f"{args.quantization} {math.exp(-sum(other) / len(other)):.3f}")
    print(f"per-token logprob difference: mean {sum(deltas) / len(deltas):.4f}, max {max(deltas):.4f}")
    print(f"greedy tokens identical: {same} of {sum(len(x) for x in base_greedy)}; first divergence per prompt: "
          f"{first}")
