"""`pagellm bench accuracy`: what a weight or arithmetic format costs in accuracy, against float32 on the same
checkpoint.

Loads the model twice: the float32 baseline (`--quantization none`, a float32 KV cache) and the format asked for
(`--quantization`, `--quantize-activations`, `--kv-cache-dtype`), and compares
1. the perplexity of a text (prompt logprobs of every token: prefill, where every format multiplies with float32
   activations) and the mean and largest per-token logprob difference;
2. decode steps, where `--quantize-activations` and a narrower KV cache apply (a prompt of one chunk attends to its
   own float32 K/V): the logprob the format gives each token it generates
   greedily, against the baseline's logprob of the same token after the same prefix;
3. greedy continuations: tokens identical, and where each first diverges.
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


def _prompt_logprobs(llm, ids: list[int]) -> list[float]:
    """The logprob of every token of `ids` after the ones before it (the first has none)."""
    from pagellm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [entry[token].logprob for entry, token in zip(out[0].prompt_logprobs[1:], ids[1:])]


def _greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy continuation and the logprob of every token in it, one prompt at a time (one
    conversation's decode batch, where `--quantize-activations` applies)."""
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    return [(o.token_ids, [entry[t].logprob for entry, t in zip(o.logprobs, o.token_ids)]) for o in outputs]


def _label(engine_args: dict) -> str:
    label = engine_args["quantization"] or "default"
    label += " + int8 activations" if engine_args["quantize_activations"] else ""
    return label + (f" + {engine_args['kv_cache_dtype']} KV cache" if engine_args["kv_cache_dtype"] != "auto" else "")


def run(args: argparse.Namespace) -> None:
    from pagellm import LLM
    from pagellm.benchmarks.machine import machine_header
    from pagellm.engine.arg_utils import EngineArgs

    engine_args = vars(EngineArgs.from_cli_args(args))
    text = args.text.read_text(encoding="utf-8")
    baseline = LLM(**{**engine_args, "quantization": "none", "quantize_activations": False, "kv_cache_dtype": "auto"})
    tokenizer = baseline.get_tokenizer()
    ids = tokenizer(text)["input_ids"][:args.max_text_tokens]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    base = _prompt_logprobs(baseline, ids)
    base_greedy = [tokens for tokens, _ in _greedy(baseline, prompts, args.greedy_tokens)]
    candidate = LLM(**engine_args)
    other = _prompt_logprobs(candidate, ids)
    other_greedy = _greedy(candidate, prompts, args.greedy_tokens)
    # the baseline's logprobs of the candidate's own continuations, token by token after the same prefix
    decode_deltas = [abs(got - want)
                     for prompt, (tokens, logprobs) in zip(prompts, other_greedy)
                     for got, want in zip(logprobs, _prompt_logprobs(baseline, prompt + tokens)[len(prompt) - 1:])]
    del baseline, candidate

    label = _label(engine_args)
    deltas = [abs(a - b) for a, b in zip(base, other)]
    other_tokens = [tokens for tokens, _ in other_greedy]
    same = sum(a == b for x, y in zip(base_greedy, other_tokens) for a, b in zip(x, y))
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(base_greedy, other_tokens)]
    print(machine_header())
    print(f"perplexity over {len(base)} tokens of {args.text}: float32 {math.exp(-sum(base) / len(base)):.3f}, "
          f"{label} {math.exp(-sum(other) / len(other)):.3f}")
    print(f"per-token logprob difference: mean {sum(deltas) / len(deltas):.4f}, max {max(deltas):.4f}")
    print(f"decode-step logprob difference over {len(decode_deltas)} generated tokens: "
          f"mean {sum(decode_deltas) / len(decode_deltas):.4f}, max {max(decode_deltas):.4f}")
    print(f"greedy tokens identical: {same} of {sum(len(x) for x in base_greedy)}; first divergence per prompt: "
          f"{first}")
