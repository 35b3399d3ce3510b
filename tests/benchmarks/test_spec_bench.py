"""`pagellm bench spec` end to end on a tiny model: no speculation and each method in one run (`draft_model` with the
model drafting for itself), every method's tokens compared with those without speculation, and the JSON report's
shape."""
from __future__ import annotations

import json

from pagellm.benchmarks import spec
from pagellm.entrypoints.cli import build_parser


def test_both_methods_against_no_speculation(tiny_model_factory, tmp_path, capsys):
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--model", str(tiny_model_factory("llama")), "--kv-cache-memory", "16MiB",
            "--output-len", "12", "--json", str(out)]
    args = build_parser(argv).parse_args(argv)
    report = spec.run(args)
    printed = capsys.readouterr().out
    assert set(report) == {"editing", "chat"}
    for workload, figures in report.items():
        assert set(figures) == {"off", *spec.BENCH_METHODS}
        for method in spec.BENCH_METHODS:
            # Greedy: speculation changes the speed, never the tokens.
            assert figures[method]["same_tokens"] is True
            assert figures[method]["on"]["output_tokens"] == figures["off"]["output_tokens"]
            assert f"{workload:<10}{method:<12}" in printed
    saved = json.loads(out.read_text())
    assert saved["config"]["methods"] == list(spec.BENCH_METHODS)
    assert saved["editing"]["suffix"]["same_tokens"] is True


def test_draft_model_alone_against_no_speculation(tiny_model_factory, tmp_path, capsys):
    model = str(tiny_model_factory("llama"))
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--model", model, "--kv-cache-memory", "16MiB", "--output-len", "12", "--repeats", "1",
            "--methods", "--draft-model", model, "--num-speculative-tokens", "3", "--json", str(out)]
    args = build_parser(argv).parse_args(argv)
    report = spec.run(args)
    printed = capsys.readouterr().out
    for workload, figures in report.items():
        assert set(figures) == {"off", "draft_model"}
        on = figures["draft_model"]["on"]
        assert figures["draft_model"]["same_tokens"] is True
        assert on["output_tokens"] == figures["off"]["output_tokens"]
        # The model drafts for itself: greedy drafts are the target's own choices, so nearly all are kept and a
        # verify step emits more than one token.
        assert on["acceptance_rate"] > 0.9 and on["tokens_per_verify_step"] > 1.5
        assert f"{workload:<10}{'draft_model':<12}" in printed
    saved = json.loads(out.read_text())
    assert saved["config"]["methods"] == ["draft_model"] and saved["config"]["draft_model"] == model
