"""`pagellm bench memory` on sliding-window models: the layer-blocks saved against full attention, counted here
from each layer's window by listing the blocks the last query reads, for Gemma 3 (5 windowed layers of 6) and
Mistral (every layer); and, measured from the engine, the blocks it held against those full attention would hold
and the blocks it freed, while the outputs stay the same (Mistral: one group; Gemma 3: one per attention type)."""
from __future__ import annotations

import importlib
import math

from transformers import AutoConfig

from pagellm.benchmarks.memory import window_savings
from pagellm.entrypoints.cli import build_parser


def bench(*argv: str):
    args = build_parser(["bench", *argv]).parse_args(["bench", *argv])
    return importlib.import_module(f"pagellm.benchmarks.{args.bench_command}").run(args)


def blocks_read(n: int, window: int | None, block_size: int) -> int:
    """Blocks holding a key the query at position n - 1 sees (keys q - window < k <= q)."""
    first = 0 if window is None else max(0, n - window)
    return len({k // block_size for k in range(first, n)})


def test_gemma3_and_mistral_savings_match_the_window_rule(tiny_model_factory):
    lens, block_size = [5, 40, 100, 333], 8
    for kind in ("gemma3", "mistral"):
        config = AutoConfig.from_pretrained(tiny_model_factory(kind))
        windows = [config.sliding_window if (getattr(config, "layer_types", None) or
                                             ["sliding_attention"] * config.num_hidden_layers)[i] ==
                   "sliding_attention" else None for i in range(config.num_hidden_layers)]
        savings = window_savings(config, config.num_hidden_layers, lens, block_size)
        assert savings["full_attention_layer_blocks"] == config.num_hidden_layers * sum(
            math.ceil(n / block_size) for n in lens)
        assert savings["windowed_layer_blocks"] == sum(blocks_read(n, w, block_size) for w in windows for n in lens)
        assert 0 < savings["saved_fraction"] < 1
        assert (None in windows) == (kind == "gemma3"), "Gemma 3 has full-attention layers, Mistral none"


def test_mistral_frees_blocks_without_changing_tokens(tiny_model_factory, capsys):
    report = bench("memory", "--model", str(tiny_model_factory("mistral")), "--num-prompts", "4", "--input-len",
                   "40:80", "--output-len", "8:16", "--pool-fraction", "0.5", "--block-size", "8")
    assert report["outputs_equal"] is True
    assert report["recompute"]["window_freed_blocks"] > 0 and report["swap"]["window_freed_blocks"] > 0
    assert report["sliding_window"]["saved_fraction"] > 0
    assert 0 < report["recompute"]["blocks_saved_fraction"] < 1, "measured from the engine, step by step"
    assert "blocks freed by the window" in capsys.readouterr().out


def test_gemma3_blocks_saved_are_measured_from_the_engine(tiny_model_factory, capsys):
    """Gemma 3's KV cache groups (one global, six local layers of one layer each): the engine holds fewer blocks
    than the same requests would with every token in every group, step by step, and the outputs are unchanged
    between recompute and swap preemption."""
    report = bench("memory", "--model", str(tiny_model_factory("gemma3")), "--num-prompts", "4", "--input-len",
                   "40:80", "--output-len", "8:16", "--pool-fraction", "0.5", "--block-size", "8")
    assert report["outputs_equal"] is True
    for mode in ("recompute", "swap"):
        figures = report[mode]
        assert figures["window_freed_blocks"] > 0
        assert 0 < figures["held_blocks_peak"] < figures["full_attention_blocks_peak"]
        assert 0 < figures["blocks_saved_fraction"] < 1
    assert "blocks saved (all steps)" in capsys.readouterr().out
