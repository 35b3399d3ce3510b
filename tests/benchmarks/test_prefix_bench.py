"""`pagellm bench prefix` and `pagellm bench memory` end to end on a tiny model: the shape of their reports and the
relations that must hold whatever the speed (caching on finds cached tokens and off none; swap preemption moves
blocks and changes no token; KV token efficiency is a fraction)."""
from __future__ import annotations

import importlib
import json
import math

import pytest

from pagellm.benchmarks.memory import pressure_args
from pagellm.benchmarks.throughput import BenchRequest
from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.cli import build_parser


def bench(*argv: str):
    args = build_parser(["bench", *argv]).parse_args(["bench", *argv])
    return importlib.import_module(f"pagellm.benchmarks.{args.bench_command}").run(args)


def test_prefix_caching_on_finds_the_shared_prompt_and_the_chat_history(tiny_model_factory, tmp_path, capsys):
    # A small token budget spreads the first prompt over steps, so later requests find its blocks cached (requests
    # admitted in the same step as the first one compute the prefix themselves).
    report = bench("prefix", "--model", str(tiny_model_factory("llama")), "--num-prompts", "4",
                      "--prefix-len", "100", "--output-len", "3", "--chat-turns", "3", "--max-num-batched-tokens",
                      "64", "--kv-cache-memory", "8MiB", "--json", str(tmp_path / "prefix.json"))
    for workload, num_requests in (("shared_prompt", 4), ("chat_replay", 3)):
        on, off = report[workload]["on"], report[workload]["off"]
        assert on["prompt_tokens"] == off["prompt_tokens"] > 100 * num_requests  # the same prompts both times
        assert on["output_tokens"] == off["output_tokens"] == 3 * num_requests
        assert off["cached_tokens"] == 0 and off["hit_rate"] == 0
        # The last token of a prompt is always computed (its logits are needed).
        assert 0 < on["cached_tokens"] <= on["prompt_tokens"] - num_requests
        assert on["hit_rate"] == pytest.approx(on["cached_tokens"] / on["prompt_tokens"])
        for figures in (on, off):
            assert 0 < figures["mean_ttft_s"] <= figures["seconds"]
            assert figures["total_tok_s"] == pytest.approx(
                (figures["prompt_tokens"] + figures["output_tokens"]) / figures["seconds"])
        assert report[workload]["throughput_gain"] == pytest.approx(on["total_tok_s"] / off["total_tok_s"])
        assert report[workload]["ttft_gain"] == pytest.approx(off["mean_ttft_s"] / on["mean_ttft_s"])
    out = capsys.readouterr().out
    assert "shared prompt: 4 requests" in out and "chat replay: 3 turns" in out
    assert out.count("prefix-cache hit rate") == 2 and out.count("caching on") == 2
    saved = json.loads((tmp_path / "prefix.json").read_text())
    assert saved["config"]["prefix_len"] == 100 and saved["shared_prompt"] == report["shared_prompt"]


def test_memory_pressure_swaps_without_changing_tokens(tiny_model_factory, tmp_path, capsys):
    report = bench("memory", "--model", str(tiny_model_factory("llama")), "--num-prompts", "6", "--input-len",
                      "16:48", "--output-len", "16:40", "--pool-fraction", "0.3", "--json", str(tmp_path / "m.json"))
    recompute, swap = report["recompute"], report["swap"]
    assert report["outputs_equal"] is True
    assert recompute["num_preemptions"] > 0 and swap["num_preemptions"] > 0
    # Swapped requests' blocks go out to the host tier and back (recompute may use the tier too: evicted cached
    # blocks are kept there as a second-level prefix cache).
    assert swap["swapped_out_blocks"] > 0 and swap["swapped_in_blocks"] > 0
    assert swap["num_host_blocks"] > 0 and recompute["num_blocks"] == swap["num_blocks"]
    for figures in (recompute, swap):
        assert 0 < figures["efficiency_min"] <= figures["efficiency_mean"] <= 1
        assert 0 < figures["pool_usage_mean"] <= 1
        assert figures["total_tokens"] > 0 and figures["total_tok_s"] > 0
    out = capsys.readouterr().out
    assert "outputs equal: yes" in out and "KV token efficiency mean" in out and "preemptions" in out
    saved = json.loads((tmp_path / "m.json").read_text())
    assert saved["outputs_equal"] is True and saved["config"]["kv_cache_memory_bytes"] > 0


def test_pressure_args_size_the_pool_from_the_workload(tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    requests = [BenchRequest([1] * 40, 30), BenchRequest([1] * 100, 50), BenchRequest([1] * 10, 6)]
    sized = pressure_args(EngineArgs(model=model), requests, 0.5)
    assert sized.max_model_len == 150  # the longest request
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16 dims, float32
    needed = math.ceil(70 / 16) + math.ceil(150 / 16) + 1  # 5 + 10 + 1 blocks held at once
    assert sized.kv_cache_memory_bytes == max(math.ceil(0.5 * needed), 10) * per_block
    # What the user sized stays as it is.
    mine = pressure_args(EngineArgs(model=model, max_model_len=512, kv_cache_memory_bytes=1 << 20), requests, 0.5)
    assert (mine.max_model_len, mine.kv_cache_memory_bytes) == (512, 1 << 20)
