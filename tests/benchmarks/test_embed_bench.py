"""`pagellm bench embed` end to end on a tiny model: both backends measured in one run, the report's figures
consistent with one another, and the two sets of vectors the same (transformers' batched, padded inference against
the engine's)."""
from __future__ import annotations

import json

import pytest

from pagellm.benchmarks.embed import run
from pagellm.entrypoints.cli import build_parser


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_bench_reports_both_backends(tiny_model_factory, tmp_path, capsys, pooling):
    argv = ["bench", "embed", "--model", str(tiny_model_factory("llama")), "--num-prompts", "12", "--input-len",
            "5:40", "--hf-batch-size", "5", "--kv-cache-memory", "8MiB", "--pooling", pooling,
            "--json", str(tmp_path / "embed.json")]
    report = run(build_parser(argv).parse_args(argv))
    for backend in ("pagellm", "transformers"):
        figures = report[backend]
        assert figures["num_inputs"] == 12 and 12 * 5 <= figures["num_tokens"] <= 12 * 40
        assert figures["inputs_per_s"] == pytest.approx(12 / figures["seconds"])
        assert figures["tokens_per_s"] == pytest.approx(figures["num_tokens"] / figures["seconds"])
    assert report["pagellm"]["num_tokens"] == report["transformers"]["num_tokens"]
    assert report["min_cosine_vs_transformers"] >= 0.99999
    assert json.loads((tmp_path / "embed.json").read_text()) == report
    assert "inputs/s" in capsys.readouterr().out
