"""`pagellm bench sharing`: KV blocks saved by block sharing for n > 1 sampling and beam search.

Runs the same prompts once with `n` samples each and once as beam search of width `--beam-width`, stepping the
engine by hand, and reports after every step the blocks actually in use (physical) and the blocks the live
block tables list (what the sequences would need if nothing were shared): the peak of each, and their sums over
all steps (block-steps, i.e. memory held over time).
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from pagellm.benchmarks.machine import machine_header
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class SharingResult:
    label: str
    peak_physical: int = 0
    peak_logical: int = 0
    physical_block_steps: int = 0
    logical_block_steps: int = 0

    def report(self) -> str:
        saved_peak = 1 - self.peak_physical / self.peak_logical
        saved_steps = 1 - self.physical_block_steps / self.logical_block_steps
        return (f"{self.label:>16}: peak {self.peak_physical} blocks used vs {self.peak_logical} without sharing "
                f"({100 * saved_peak:.1f}% saved); over time {self.physical_block_steps} vs "
                f"{self.logical_block_steps} block-steps ({100 * saved_steps:.1f}% saved)")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--dataset-seed", type=int, default=0)


def measure(engine: LLMEngine, label: str, add_requests) -> SharingResult:
    kv = engine.engine_core.kv_cache_manager
    add_requests()
    result = SharingResult(label)
    while engine.has_unfinished_requests():
        engine.step()
        physical, logical = kv.block_pool.num_used_blocks, kv.num_logical_blocks
        result.peak_physical = max(result.peak_physical, physical)
        result.peak_logical = max(result.peak_logical, logical)
        result.physical_block_steps += physical
        result.logical_block_steps += logical
    return result


def run(args: argparse.Namespace) -> list[SharingResult]:
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    rng = random.Random(args.dataset_seed)
    vocab = engine.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    sampling = SamplingParams(n=args.n, temperature=1.0, seed=0, max_tokens=args.output_len, ignore_eos=True)
    beams = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len, ignore_eos=True)

    def add(add_request, params, prefix: str):
        return lambda: [add_request(f"{prefix}-{i}", p, params) for i, p in enumerate(prompts)]

    results = [measure(engine, f"n={args.n}", add(engine.add_request, sampling, "n")),
               measure(engine, f"beam_width={args.beam_width}",
                       add(engine.add_beam_search_request, beams, "beam"))]
    print(machine_header())
    print(f"{args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} output tokens each, "
          f"block size {engine.config.cache_config.block_size}")
    for result in results:
        print(result.report())
    return results
