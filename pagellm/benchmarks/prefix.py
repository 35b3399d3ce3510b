"""`pagellm bench prefix`: what automatic prefix caching saves, measured with it on and off in one run.

Two workloads run on an engine with prefix caching, then on one without (built one after the other, every other
flag the same; `--enable-prefix-caching` itself is ignored):

- shared prompt: `--num-prompts` requests with the same `--prefix-len`-token system prompt and each its own short
  question (through the chat template), submitted at once, `--output-len` tokens each;
- chat replay: one conversation of `--chat-turns` turns with that system prompt, where each turn resends the
  whole history (the earlier questions and the model's own replies) and waits for its reply.

Per workload and setting: total tok/s (every prompt token, cached or not, and every generated token, over the
wall time), mean TTFT (from submission until the request's first token comes out of `LLMEngine.step_outputs`),
and the hit rate (prompt tokens taken from the cache, `RequestOutput.num_cached_tokens`, over all prompt tokens).
Decoding is greedy with ignore_eos, so both settings do the same work. The system prompt is real English text,
the docstrings of pagellm's own modules, the same from run to run of one version of the code.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import gc
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagellm.benchmarks.machine import machine_header
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

SETTINGS = {"on": True, "off": False}
_request_ids = itertools.count()


@dataclass
class WorkloadResult:
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttfts) / len(self.ttfts)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "total_tok_s": self.total_tok_s, "mean_ttft_s": self.mean_ttft,
                "hit_rate": self.hit_rate, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64, help="requests sharing the system prompt")
    parser.add_argument("--prefix-len", type=int, default=1000, help="tokens of the shared system prompt")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request and per turn")
    parser.add_argument("--chat-turns", type=int, default=10, help="turns of the chat replay (0: skip it)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def system_prompt(tokenizer, num_tokens: int, start: int = 0) -> str:
    """`num_tokens` tokens of the module docstrings of pagellm from token `start` on (they repeat if the package
    ever has fewer)."""
    root = Path(__file__).resolve().parent.parent
    docs = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) for path in sorted(root.rglob("*.py")))
    ids = tokenizer.encode("\n\n".join(doc for doc in docs if doc), add_special_tokens=False)
    return tokenizer.decode(list(itertools.islice(itertools.cycle(ids), start, start + num_tokens)))


def question(index: int) -> str:
    return f"Question {index + 1}: in one sentence, what does part {index + 1} of the notes above explain?"


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already holds any BOS (as in LLM.chat).
    return tokenizer.encode(text, add_special_tokens=False)


def generate(engine: LLMEngine, prompts: list[list[int]], output_len: int,
             result: WorkloadResult | None = None) -> list[RequestOutput]:
    """Submit every prompt at once and step the engine until all finish; add their figures to `result`."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    ids = [str(next(_request_ids)) for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first_token: dict[str, float] = {}
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        outputs, _ = engine.step_outputs()
        now = time.perf_counter()
        for output in outputs:
            first_token.setdefault(output.request_id, now - start)
            if output.finished:
                finished[output.request_id] = output
    ordered = [finished[request_id] for request_id in ids]
    if result is not None:
        result.seconds += time.perf_counter() - start
        result.ttfts += [first_token[request_id] for request_id in ids]
        result.prompt_tokens += sum(len(p) for p in prompts)
        result.output_tokens += sum(len(o.outputs[0].token_ids) for o in ordered)
        result.cached_tokens += sum(o.num_cached_tokens or 0 for o in ordered)
    return ordered


def shared_prompt_workload(engine: LLMEngine, system: str, num_prompts: int, output_len: int) -> WorkloadResult:
    tokenizer = engine.tokenizer
    prompts = [chat_prompt(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": question(i)}])
               for i in range(num_prompts)]
    result = WorkloadResult()
    generate(engine, prompts, output_len, result)
    return result


def chat_replay_workload(engine: LLMEngine, system: str, turns: int, output_len: int) -> WorkloadResult:
    messages = [{"role": "system", "content": system}]
    result = WorkloadResult()
    for turn in range(turns):
        messages.append({"role": "user", "content": question(turn)})
        (output,) = generate(engine, [chat_prompt(engine.tokenizer, messages)], output_len, result)
        messages.append({"role": "assistant", "content": output.outputs[0].text})
    return result


def run_setting(engine_args: EngineArgs, caching: bool, args: argparse.Namespace) -> dict[str, WorkloadResult]:
    engine = LLMEngine.from_engine_args(dataclasses.replace(engine_args, enable_prefix_caching=caching))
    # Warm-up: kernels built and first-use costs paid; its prompt shares no block with the workloads'.
    generate(engine, [chat_prompt(engine.tokenizer, [{"role": "user", "content": question(-1)}])], 2)
    system = system_prompt(engine.tokenizer, args.prefix_len)
    results = {"shared_prompt": shared_prompt_workload(engine, system, args.num_prompts, args.output_len)}
    if args.chat_turns:
        # The next stretch of text: the chat must not find its system prompt cached by the first workload.
        chat_system = system_prompt(engine.tokenizer, args.prefix_len, start=args.prefix_len)
        results["chat_replay"] = chat_replay_workload(engine, chat_system, args.chat_turns, args.output_len)
    return results


def format_table(title: str, on: WorkloadResult, off: WorkloadResult) -> str:
    """One workload, caching on and off; gain is on over off for tok/s, off over on for times."""
    rows = [("total tok/s", f"{on.total_tok_s:.1f}", f"{off.total_tok_s:.1f}", on.total_tok_s / off.total_tok_s),
            ("wall time (s)", f"{on.seconds:.2f}", f"{off.seconds:.2f}", off.seconds / on.seconds),
            ("mean TTFT (s)", f"{on.mean_ttft:.3f}", f"{off.mean_ttft:.3f}", off.mean_ttft / on.mean_ttft),
            ("prefix-cache hit rate", f"{100 * on.hit_rate:.1f}%", f"{100 * off.hit_rate:.1f}%", None)]
    lines = [title, f"  {'':<24}{'caching on':>12}{'caching off':>13}{'gain':>9}"]
    lines += [f"  {name:<24}{a:>12}{b:>13}{'' if gain is None else f'{gain:.2f}x':>9}" for name, a, b, gain in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    if args.num_prompts < 1 or args.prefix_len < 1 or args.output_len < 1 or args.chat_turns < 0:
        raise ValueError("--num-prompts, --prefix-len and --output-len must be >= 1, --chat-turns >= 0")
    engine_args = EngineArgs.from_cli_args(args)
    results = {}
    for name, caching in SETTINGS.items():
        results[name] = run_setting(engine_args, caching, args)
        gc.collect()  # free this engine's KV pool before the next one allocates its own
    on, off = results["on"], results["off"]
    shared = on["shared_prompt"]
    print(machine_header())
    print(format_table(f"shared prompt: {args.num_prompts} requests of {shared.prompt_tokens / args.num_prompts:.0f} "
                       f"prompt tokens on average (system prompt {args.prefix_len}), {args.output_len} output "
                       f"tokens each, submitted at once", shared, off["shared_prompt"]))
    if args.chat_turns:
        chat = on["chat_replay"]
        print(format_table(f"chat replay: {args.chat_turns} turns, {chat.prompt_tokens} prompt tokens in all "
                           f"(each turn resends the history), {args.output_len} output tokens per turn", chat,
                           off["chat_replay"]))
    report = {workload: {name: results[name][workload].to_dict() for name in SETTINGS} for workload in on}
    for figures in report.values():
        figures["throughput_gain"] = figures["on"]["total_tok_s"] / figures["off"]["total_tok_s"]
        figures["ttft_gain"] = figures["off"]["mean_ttft_s"] / figures["on"]["mean_ttft_s"]
    if args.json:
        config = {k: getattr(args, k) for k in ("num_prompts", "prefix_len", "output_len", "chat_turns")}
        Path(args.json).write_text(json.dumps({"config": config, **report}, indent=2))
    return report
