"""`pagellm bench memory`: the engine on a deliberately small KV pool, preempting by recompute and by swap.

One mixed-length workload (random token ids, lengths drawn as in `bench throughput`, greedy, ignore_eos, all
submitted at once) runs with preemption_mode="recompute" and then "swap", on engines built one after the other
with every other flag the same. Unless `--kv-cache-memory` is given, the device pool holds `--pool-fraction` of
the blocks the whole workload would hold at once, and `--max-model-len` defaults to the longest request so that a
pool that small is allowed. Per mode: total tok/s, preemptions, blocks copied out to the host tier and back in
(swapped requests' blocks, and evicted cached blocks kept there as a second-level prefix cache), how many of the
preempted requests' tokens came back from the prefix cache (with prefix caching on, a "recomputed" request finds
its freed blocks cached, on the device or in the host tier, and recomputes only the rest), and the KV token
efficiency: tokens stored / capacity of the blocks requests hold (`kv_cache_token_efficiency`), sampled after
every step that ran a request, mean and minimum. Paged blocks waste at most the unfilled tail of each request's
last block; the vLLM paper measured 60-80% of KV memory wasted by systems that reserve a contiguous slot per
request. Last, whether both modes generated the same tokens.

Sliding windows (Mistral: every layer; Gemma 3: 5 layers of 6): the KV layer-blocks the requests need at their
final length if every layer kept every token, against only the blocks each layer's window still reads (a query at
q reads keys q - W < k <= q), counted from the config; and, measured from the engine after every step, the blocks
its KV cache groups hold (core/kv/kv_cache_groups.py: a block is a page of one group's layers) against the blocks
the same running requests would hold if every group kept every token, and the blocks freed as they left a window.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagellm.benchmarks.machine import machine_header
from pagellm.benchmarks.throughput import BenchRequest, make_requests, parse_range
from pagellm.core.kv.kv_cache_groups import blocks_needed, group_size, kv_cache_groups
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.model_executor.layers.attention import layer_sliding_window
from pagellm.sampling_params import SamplingParams

MODES = ("recompute", "swap")


@dataclass
class ModeResult:
    mode: str
    num_blocks: int = 0  # device pool
    num_host_blocks: int = 0
    seconds: float = 0.0
    total_tokens: int = 0
    num_preemptions: int = 0
    swapped_out_blocks: int = 0  # copied to the host tier
    swapped_in_blocks: int = 0  # copied back from it
    preempted_queries: int = 0  # tokens of preempted requests looked up in the prefix cache on readmission
    preempted_hits: int = 0
    window_freed_blocks: int = 0  # freed because they fell out of the sliding window
    held_blocks: list[int] = field(default_factory=list)  # device blocks held after each step
    full_attention_blocks: list[int] = field(default_factory=list)  # the same requests, every token in every group
    efficiency: list[float] = field(default_factory=list)  # kv_cache_token_efficiency after each step
    pool_usage: list[float] = field(default_factory=list)  # used / all device blocks after each step
    token_ids: list[list[int]] = field(default_factory=list)  # per request, in submission order

    def to_dict(self) -> dict:
        figures = {k: v for k, v in dataclasses.asdict(self).items()
                   if k not in ("efficiency", "pool_usage", "token_ids", "held_blocks", "full_attention_blocks")}
        return {**figures, "total_tok_s": self.total_tokens / self.seconds,
                "efficiency_mean": _mean(self.efficiency), "efficiency_min": min(self.efficiency),
                "pool_usage_mean": _mean(self.pool_usage), "held_blocks_peak": max(self.held_blocks),
                "full_attention_blocks_peak": max(self.full_attention_blocks),
                "blocks_saved_fraction": self.saved_fraction}

    @property
    def saved_fraction(self) -> float:
        """1 - blocks held / blocks full attention would hold, summed over the steps."""
        full = sum(self.full_attention_blocks)
        return 1 - sum(self.held_blocks) / full if full else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=parse_range, default=(32, 512), help="N or MIN:MAX prompt tokens")
    parser.add_argument("--output-len", type=parse_range, default=(32, 256), help="N or MIN:MAX output tokens")
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--pool-fraction", type=float, default=0.25,
                        help="device KV pool as a share of the blocks all requests would hold at once (unless "
                             "--kv-cache-memory is given)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def pressure_args(engine_args: EngineArgs, requests: list[BenchRequest], fraction: float) -> EngineArgs:
    """The engine arguments with a device pool of `fraction` of the workload's blocks (at least one request of
    max_model_len), unless the user sized it."""
    from pagellm.worker.cache_engine import kv_bytes_per_block

    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    max_model_len = engine_args.max_model_len or longest
    engine_args = dataclasses.replace(engine_args, max_model_len=max_model_len)
    if engine_args.kv_cache_memory_bytes is not None:
        return engine_args
    block_size = engine_args.block_size
    config = engine_args.create_engine_config()
    model_config = config.model_config
    groups = kv_cache_groups([layer_sliding_window(model_config.hf_config, i) for i in range(model_config.num_layers)])
    # In blocks of one group's layers: every group keeps every token, for all requests at once.
    needed = len(groups) * sum(math.ceil((len(r.prompt_token_ids) + r.output_len) / block_size) for r in requests)
    chunk = min(max_model_len, config.scheduler_config.max_num_batched_tokens)
    one_request = blocks_needed([g.window for g in groups], max_model_len - chunk, chunk, block_size)
    num_blocks = max(math.ceil(fraction * needed), one_request)
    per_block = kv_bytes_per_block(model_config, config.cache_config, num_layers=group_size(groups))
    return dataclasses.replace(engine_args, kv_cache_memory_bytes=num_blocks * per_block)


def window_savings(hf_config, num_layers: int, seq_lens: list[int], block_size: int) -> dict:
    """Layer-blocks the sequences hold at their final lengths with every token kept in every layer, and with each
    layer keeping only the blocks its last query still reads."""
    full = windowed = 0
    for layer in range(num_layers):
        window = layer_sliding_window(hf_config, layer)
        for n in seq_lens:
            blocks = math.ceil(n / block_size)
            full += blocks
            skipped = 0 if window is None else max(0, n - window) // block_size  # before the last query's window
            windowed += blocks - skipped
    return {"full_attention_layer_blocks": full, "windowed_layer_blocks": windowed,
            "saved_fraction": 1 - windowed / full if full else 0.0}


def run_mode(engine_args: EngineArgs, mode: str, requests: list[BenchRequest]) -> ModeResult:
    engine = LLMEngine.from_engine_args(dataclasses.replace(engine_args, preemption_mode=mode))
    engine.add_request("warm-up", {"prompt_token_ids": requests[0].prompt_token_ids[:8]},
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    scheduler = engine.engine_core.scheduler
    num_groups, block_size = len(engine.engine_core.kv_cache_manager.groups), engine_args.block_size
    before = scheduler.stats()
    result = ModeResult(mode, before.num_blocks, before.num_host_blocks)
    finished = {}
    start = time.perf_counter()
    for i, request in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": request.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs, _ = engine.step()
        finished.update((o.request_id, o) for o in outputs)
        stats = scheduler.stats()
        if stats.num_running:  # an idle pool holds nothing to measure
            result.efficiency.append(stats.kv_cache_token_efficiency)
            result.pool_usage.append(stats.kv_cache_usage)
            result.held_blocks.append(stats.num_used_blocks)
            result.full_attention_blocks.append(num_groups * sum(
                math.ceil(r.num_computed_tokens / block_size) for r in scheduler.running))
    result.seconds = time.perf_counter() - start
    after = scheduler.stats()
    result.token_ids = [list(finished[str(i)].outputs[0].token_ids) for i in range(len(requests))]
    result.total_tokens = sum(len(r.prompt_token_ids) for r in requests) + sum(map(len, result.token_ids))
    result.num_preemptions = after.num_preemptions_total - before.num_preemptions_total
    result.swapped_out_blocks = after.num_swapped_out_blocks_total - before.num_swapped_out_blocks_total
    result.swapped_in_blocks = after.num_swapped_in_blocks_total - before.num_swapped_in_blocks_total
    result.preempted_queries = after.prefix_cache_preempted_queries - before.prefix_cache_preempted_queries
    result.preempted_hits = after.prefix_cache_preempted_hits - before.prefix_cache_preempted_hits
    result.window_freed_blocks = engine.engine_core.kv_cache_manager.num_window_freed_blocks
    return result


def format_table(results: list[ModeResult]) -> str:
    rows = [("total tok/s", lambda r: f"{r.total_tokens / r.seconds:.1f}"),
            ("wall time (s)", lambda r: f"{r.seconds:.2f}"),
            ("preemptions", lambda r: str(r.num_preemptions)),
            ("blocks to / from host", lambda r: f"{r.swapped_out_blocks} / {r.swapped_in_blocks}"),
            ("preempted tokens cached", lambda r: f"{r.preempted_hits} of {r.preempted_queries}"),
            ("KV token efficiency mean", lambda r: f"{_mean(r.efficiency):.3f}"),
            ("KV token efficiency min", lambda r: f"{min(r.efficiency):.3f}"),
            ("device pool usage mean", lambda r: f"{100 * _mean(r.pool_usage):.1f}%"),
            ("blocks freed by the window", lambda r: str(r.window_freed_blocks)),
            ("peak blocks held", lambda r: str(max(r.held_blocks))),
            ("  with full attention", lambda r: str(max(r.full_attention_blocks))),
            ("blocks saved (all steps)", lambda r: f"{100 * r.saved_fraction:.1f}%")]
    lines = [f"  {'':<26}" + "".join(f"{r.mode:>16}" for r in results)]
    lines += [f"  {name:<26}" + "".join(f"{cell(r):>16}" for r in results) for name, cell in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    if args.num_prompts < 1 or not 0 < args.pool_fraction <= 1:
        raise ValueError("--num-prompts must be >= 1 and --pool-fraction in (0, 1]")
    engine_args = EngineArgs.from_cli_args(args)
    vocab = engine_args.create_engine_config().model_config.vocab_size
    requests = make_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.dataset_seed)
    engine_args = pressure_args(engine_args, requests, args.pool_fraction)
    results = []
    for mode in MODES:
        results.append(run_mode(engine_args, mode, requests))
        gc.collect()  # free this engine's KV pool before the next one allocates its own
    equal = results[0].token_ids == results[1].token_ids
    prompt_tokens, output_tokens = sum(len(r.prompt_token_ids) for r in requests), sum(r.output_len for r in requests)
    print(machine_header())
    print(f"{len(requests)} requests, prompts {args.input_len[0]}:{args.input_len[1]} ({prompt_tokens} tokens), "
          f"outputs {args.output_len[0]}:{args.output_len[1]} ({output_tokens} tokens); device KV pool "
          f"{results[0].num_blocks} blocks of {engine_args.block_size} tokens, host tier {results[0].num_host_blocks} "
          f"blocks, max_model_len {engine_args.max_model_len}")
    print(format_table(results))
    print(f"outputs equal: {'yes' if equal else 'no'}")
    model_config = engine_args.create_engine_config().model_config
    savings = window_savings(model_config.hf_config, model_config.num_layers,
                             [len(r.prompt_token_ids) + r.output_len for r in requests], engine_args.block_size)
    print(f"sliding windows: {savings['windowed_layer_blocks']} layer-blocks at the requests' final lengths instead "
          f"of {savings['full_attention_layer_blocks']} with full attention ({100 * savings['saved_fraction']:.1f}% "
          f"saved)")
    report = {"outputs_equal": equal, "sliding_window": savings, **{r.mode: r.to_dict() for r in results}}
    if args.json:
        config = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                  "kv_cache_memory_bytes": engine_args.kv_cache_memory_bytes,
                  "max_model_len": engine_args.max_model_len}
        Path(args.json).write_text(json.dumps({"config": config, **report}, indent=2))
    return report
