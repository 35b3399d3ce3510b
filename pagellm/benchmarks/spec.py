"""`pagellm bench spec`: batch-1 decode speed with speculative decoding (each of `--methods`: `ngram` prompt lookup,
`suffix` decoding; and `draft_model` with `--draft-model PATH`) against without, in one run, on two workloads through
the chat template, greedy (so every setting emits the same tokens):

- editing: the prompt holds a code block (a class of pagellm's own source) and asks for it back with one change,
  so the answer repeats much of the prompt: the case both drafters are for;
- chat: open questions, whose answers repeat little.

One engine per setting, all loaded at once (each with a small KV pool); each prompt runs through every engine in
turn, `--repeats` rounds, and each prompt's fastest run counts, so a shared host's slow spells fall on every setting
alike and drop out. The suffix drafter's cache of finished outputs is off here: a repeated prompt would find its own
earlier answer. Per workload and setting: decode tok/s (output tokens after the first, over the time from the first
token to the last), and with speculation the acceptance rate (accepted over drafted tokens, all rounds) and the mean
tokens per step of a speculating request. The outputs are compared token for token with those without speculation.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import time
from pathlib import Path

from pagellm.benchmarks.machine import machine_header
from pagellm.config import SpeculativeConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import SamplingParams

_request_ids = itertools.count()
BENCH_METHODS = ("ngram", "suffix")  # the model-free drafters
KV_BYTES = 512 << 20  # each engine's KV pool unless --kv-cache-memory says otherwise: one 8k-token request fits
# The editing prompts' code: pagellm's prompt lookup drafter as it was on 2026-11-27, kept verbatim so that the
# workload stays the same as the drafter changes.
EDITING_SOURCE = """\
class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens

    def propose(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None) -> list[int]:
        \"\"\"Up to min(k, max_tokens) draft tokens to follow `token_ids` (prompt and output so far); [] when no
        suffix n-gram recurs.\"\"\"
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows starting before the suffix itself, so that at least one token follows each match.
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start:start + k].tolist()
        return []
"""
CHAT_QUESTIONS = ("Explain in a few paragraphs how a bicycle stays upright.",
                  "Write a short story about a lighthouse keeper who finds a message in a bottle.")


def editing_prompts() -> list[str]:
    source = EDITING_SOURCE
    return [f"Here is a Python class:\n\n```python\n{source}```\n\nRewrite it with `min_n` renamed to `shortest`. "
            f"Reply with the whole class in a code block and nothing else.",
            f"Here is a Python class:\n\n```python\n{source}```\n\nRepeat the class exactly, adding a one-line "
            f"comment above `propose`. Reply with the whole class in a code block."]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-len", type=int, default=256, help="most tokens generated per prompt")
    parser.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens,
                        help="k: the most tokens a request drafts")
    parser.add_argument("--methods", nargs="*", choices=BENCH_METHODS, default=list(BENCH_METHODS),
                        help="model-free speculative methods to run beside no speculation (none: only "
                             "--draft-model's)")
    parser.add_argument("--draft-model", default=None, metavar="PATH",
                        help="also run method draft_model with this draft (a GGUF file or checkpoint directory)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the prompts; each prompt's best counts")
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


def start_engine(engine_args: EngineArgs, spec: dict | None) -> LLMEngine:
    engine = LLMEngine.from_engine_args(dataclasses.replace(engine_args, speculative_config=spec))
    decode_one(engine, encode(engine, "Hello."), 8)  # warm-up: kernels built, first-use costs paid
    return engine


def encode(engine: LLMEngine, text: str) -> list[int]:
    tokenizer = engine.tokenizer
    messages = [{"role": "user", "content": text}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)


def run(args: argparse.Namespace) -> dict:
    if args.output_len < 2 or args.num_speculative_tokens < 1 or args.repeats < 1:
        raise ValueError("--output-len must be >= 2, --num-speculative-tokens and --repeats >= 1")
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), max_num_seqs=1)
    if engine_args.kv_cache_memory_bytes is None:  # one request at a time: a small pool for each engine
        # A draft model's cache shares the pool, block for block: twice the bytes fit a draft up to the target's size.
        engine_args = dataclasses.replace(engine_args, kv_cache_memory_bytes=KV_BYTES * (2 if args.draft_model else 1))
    methods = list(args.methods) + (["draft_model"] if args.draft_model else [])
    settings: dict[str, dict | None] = {"off": None}
    for method in methods:
        settings[method] = {"method": method, "num_speculative_tokens": args.num_speculative_tokens}
        if method == "suffix":
            settings[method]["suffix_decoding_max_cached_requests"] = 0  # no answer found in its own last repeat
        if method == "draft_model":
            settings[method]["model"] = args.draft_model
    engines = {name: start_engine(engine_args, spec) for name, spec in settings.items()}
    first = engines["off"]
    workloads = {name: [encode(first, text) for text in texts]
                 for name, texts in (("editing", editing_prompts()), ("chat", list(CHAT_QUESTIONS)))}
    seconds = {(name, w, i): math.inf for name in engines for w, ps in workloads.items() for i in range(len(ps))}
    outputs: dict[tuple[str, str, int], list[int]] = {}
    counts = {(name, w): [0, 0, 0] for name in engines for w in workloads}  # drafts, drafted, accepted
    # Round-robin, each prompt through every engine in turn, best of the repeats: a loaded host's slow spells fall
    # on all settings alike and drop out of the minimum.
    for _ in range(args.repeats):
        for w, prompts in workloads.items():
            for i, prompt in enumerate(prompts):
                for name, engine in engines.items():
                    stats = engine.engine_core.scheduler.spec_decoding_stats
                    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
                    tokens, elapsed = decode_one(engine, prompt, args.output_len)
                    seconds[name, w, i] = min(seconds[name, w, i], elapsed)
                    outputs.setdefault((name, w, i), tokens)
                    after = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
                    counts[name, w] = [c + b - a for c, a, b in zip(counts[name, w], before, after)]
    for engine in engines.values():
        engine.shutdown()
    print(machine_header())
    print(f"batch-1 greedy decode, k={args.num_speculative_tokens}, up to {args.output_len} tokens per prompt, best "
          f"of {args.repeats}")
    print(f"  {'workload':<10}{'method':<12}{'off tok/s':>11}{'on tok/s':>10}{'speedup':>9}{'accepted':>10}"
          f"{'tok/step':>10}{'same tokens':>13}")
    report: dict = {}
    for w, prompts in workloads.items():
        decoded = sum(len(outputs["off", w, i]) - 1 for i in range(len(prompts)))
        rates = {name: sum(len(outputs[name, w, i]) - 1 for i in range(len(prompts)))
                 / sum(seconds[name, w, i] for i in range(len(prompts))) for name in engines}
        report[w] = {"off": {"decode_tok_s": rates["off"], "output_tokens": decoded + len(prompts)}}
        for method in methods:
            drafts, drafted, accepted = counts[method, w]
            rate = accepted / drafted if drafted else None
            per_step = (accepted + drafts) / drafts if drafts else None
            same = all(outputs[method, w, i] == outputs["off", w, i] for i in range(len(prompts)))
            speedup = rates[method] / rates["off"]
            print(f"  {w:<10}{method:<12}{rates['off']:>11.1f}{rates[method]:>10.1f}{speedup:>8.2f}x"
                  f"{'-' if rate is None else f'{100 * rate:.0f}%':>10}"
                  f"{'-' if per_step is None else f'{per_step:.2f}':>10}{str(same):>13}")
            report[w][method] = {"on": {"decode_tok_s": rates[method], "acceptance_rate": rate,
                                        "tokens_per_verify_step": per_step,
                                        "output_tokens": sum(len(outputs[method, w, i]) for i in range(len(prompts)))},
                                 "speedup": speedup, "same_tokens": same}
    if args.json:
        Path(args.json).write_text(json.dumps({"config": {"output_len": args.output_len, "methods": methods,
                                                          "num_speculative_tokens": args.num_speculative_tokens,
                                                          "draft_model": args.draft_model,
                                                          "repeats": args.repeats}, **report}, indent=2))
    return report
