"""`pagellm bench serve --mix`: short and long requests mixed, TTFT reported per class; the maths on synthetic
timings, the prompts, and a run against a live short-first server."""
from __future__ import annotations

import argparse

import pytest

from pagellm.benchmarks import serve as bench
from pagellm.benchmarks import serve_load, serve_metrics, serve_prompts


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    return parser.parse_args(["--disable-tqdm", *argv])


def test_mix_flag_parses_and_rejects_nonsense():
    assert parse("--mix", "0.1:1024:128").mix == (0.1, 1024, 128)
    for bad in ("0:10:10", "1:10:10", "0.1:0:10", "0.1:10", "a:b:c"):
        with pytest.raises(SystemExit):
            parse("--mix", bad)


def test_mixed_prompts_place_the_long_ones_by_the_seed():
    tokenizer = serve_prompts.load_tokenizer(None)
    prompts, is_long = serve_prompts.mixed_prompts(tokenizer, 20, 16, 4, 0.0, (0.25, 64, 9), seed=3)
    assert sum(is_long) == 5 and len(prompts) == 20
    assert all((p.output_len, p.prompt_len > 40) == ((9, True) if long else (4, False))
               for p, long in zip(prompts, is_long))
    assert serve_prompts.mixed_prompts(tokenizer, 20, 16, 4, 0.0, (0.25, 64, 9), seed=3) == (prompts, is_long)
    assert serve_prompts.mixed_prompts(tokenizer, 20, 16, 4, 0.0, (0.25, 64, 9), seed=4)[1] != is_long
    assert sum(serve_prompts.mixed_prompts(tokenizer, 3, 16, 4, 0.0, (0.01, 64, 9), seed=0)[1]) == 1  # at least one


def test_class_metrics_split_short_and_long():
    R = serve_load.RequestResult
    results = [R(True, ttft=t) for t in (0.1, 0.2, 0.3, 0.4)] + [R(True, ttft=2.0), R(True, ttft=5.0),
                                                                R(False, error="boom")]
    is_long = [False] * 4 + [True, True, False]
    metrics = serve_metrics.class_metrics(results, is_long)
    assert metrics["short_completed"] == 4 and metrics["long_completed"] == 2
    assert metrics["short_p50_ttft_ms"] == pytest.approx(250.0)
    assert metrics["short_p99_ttft_ms"] == pytest.approx(397.0)
    assert metrics["long_max_ttft_ms"] == pytest.approx(5000.0)
    report = serve_metrics.format_report({**serve_metrics.compute_metrics(results, 1.0), **metrics}, ["ttft"], [99.0],
                                         None)
    assert "Short P99 TTFT (ms):" in report and "Long max TTFT (ms):" in report


def test_mix_is_for_random_prompts_only(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    with pytest.raises(ValueError, match="--mix"):
        bench.run(parse("--dataset-path", str(prompts), "--mix", "0.5:8:8"))


@pytest.fixture(scope="module")
def short_first_server(tiny_model_factory, start_server):
    yield from start_server(tiny_model_factory("llama"), "--scheduling-policy", "short-first")


def test_mixed_run_against_a_short_first_server(short_first_server, tmp_path, capsys):
    metrics = bench.run(parse("--base-url", short_first_server.url, "--num-prompts", "8", "--random-input-len",
                              "16", "--random-output-len", "4", "--mix", "0.25:180:12", "--request-rate", "20",
                              "--save-result", str(tmp_path / "r.json")))
    assert metrics["completed"] == 8 and metrics["failed"] == 0
    assert (metrics["short_completed"], metrics["long_completed"]) == (6, 2)
    assert 0 < metrics["short_p50_ttft_ms"] <= metrics["short_p99_ttft_ms"] and metrics["long_max_ttft_ms"] > 0
    assert metrics["total_output_tokens"] == 6 * 4 + 2 * 12
    assert "TTFT by request class (--mix)" in capsys.readouterr().out
    assert '"mix": [' in (tmp_path / "r.json").read_text()
