"""What /metrics and the periodic log line make of the scheduler's snapshot (a SchedulerStats built here): each
gauge and cumulative counter of the prefix cache, the host tier and swapping is read at scrape time, and the log
line's prefix cache hit rate covers the interval since the previous line."""
from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagellm.config import CacheConfig
from pagellm.metrics import loggers
from pagellm.metrics.loggers import LoggingStatLogger
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.stats import IterationStats, SchedulerStats

STATS = SchedulerStats(num_running=2, num_waiting=1, num_used_blocks=30, num_blocks=120, num_preemptions_total=4,
                       prefix_cache_queries=900, prefix_cache_hits=320, prefix_cache_preempted_queries=70,
                       prefix_cache_preempted_hits=64, kv_cache_token_efficiency=0.75, num_used_host_blocks=5,
                       num_host_blocks=20, num_swapped_out_blocks_total=11, num_swapped_in_blocks_total=6)
EXPECTED = {  # metric -> (type, value)
    "pagellm:num_requests_running": ("gauge", 2),
    "pagellm:num_requests_waiting": ("gauge", 1),
    "pagellm:kv_cache_usage_perc": ("gauge", 0.25),
    "pagellm:kv_cache_token_efficiency": ("gauge", 0.75),
    "pagellm:host_kv_cache_usage_perc": ("gauge", 0.25),
    "pagellm:host_kv_cache_used_blocks": ("gauge", 5),
    "pagellm:host_kv_cache_num_blocks": ("gauge", 20),
    "pagellm:num_preemptions": ("counter", 4),
    "pagellm:prefix_cache_queries": ("counter", 900),
    "pagellm:prefix_cache_hits": ("counter", 320),
    "pagellm:prefix_cache_preempted_queries": ("counter", 70),
    "pagellm:prefix_cache_preempted_hits": ("counter", 64),
    "pagellm:num_swapped_out_blocks": ("counter", 11),
    "pagellm:num_swapped_in_blocks": ("counter", 6),
}


def scrape(stat_logger: PrometheusStatLogger) -> dict[str, tuple[str, float]]:
    """The registry's families as {name: (type, value of the tiny model's sample)}."""
    text = generate_latest(stat_logger.registry).decode()
    return {family.name: (family.type, family.samples[0].value) for family in text_string_to_metric_families(text)
            if family.samples and family.samples[0].labels.get("model_name") == "tiny"}


def test_scheduler_snapshot_is_exported_at_scrape_time():
    snapshot = [STATS]
    stat_logger = PrometheusStatLogger("tiny", lambda: [snapshot[0]])
    metrics = scrape(stat_logger)
    assert {name: metrics[name] for name in EXPECTED} == EXPECTED
    snapshot[0] = SchedulerStats(0, 0, 0, 120, 4, prefix_cache_queries=1000, prefix_cache_hits=400)
    metrics = scrape(stat_logger)
    assert metrics["pagellm:prefix_cache_hits"] == ("counter", 400)
    assert metrics["pagellm:host_kv_cache_usage_perc"] == ("gauge", 0)  # no host tier: 0, not a division by zero


def test_the_cache_config_is_exported_as_labels():
    """vLLM's cache_config_info: a gauge at 1 whose labels are the KV cache's settings, with the element type the
    cache holds."""
    info = CacheConfig(block_size=32, cache_dtype="fp8", swap_space_bytes=0).metrics_info(torch.float32)
    text = generate_latest(PrometheusStatLogger("tiny", lambda: [STATS], info).registry).decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "pagellm:cache_config_info"]
    [sample] = family.samples
    assert family.type == "gauge" and sample.value == 1
    assert {key: sample.labels[key] for key in ("model_name", "block_size", "cache_dtype", "kv_dtype",
                                                "enable_prefix_caching", "swap_space_bytes")} == {
        "model_name": "tiny", "block_size": "32", "cache_dtype": "fp8", "kv_dtype": "float8_e4m3fn",
        "enable_prefix_caching": "True", "swap_space_bytes": "0"}


def test_prompt_tokens_are_not_counted_as_prefix_cache_queries():
    """Queries come from the scheduler (what it looked up), not from the prompt tokens outputs report."""
    stat_logger = PrometheusStatLogger("tiny", lambda: [STATS])
    stat_logger.record(IterationStats(num_prompt_tokens=500))
    metrics = scrape(stat_logger)
    assert metrics["pagellm:prompt_tokens"] == ("counter", 500)
    assert metrics["pagellm:prefix_cache_queries"] == ("counter", 900)


@pytest.fixture
def log_lines(monkeypatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(loggers.logger, "info", lambda message, *args: lines.append(message % args))
    return lines


def test_log_line_reports_the_prefix_cache_hit_rate_since_the_last_line(log_lines):
    snapshot = [SchedulerStats(1, 0, 10, 100, 0, prefix_cache_queries=200, prefix_cache_hits=50)]
    stat_logger = LoggingStatLogger(lambda: snapshot[0])
    stat_logger.log()
    snapshot[0] = SchedulerStats(1, 0, 10, 100, 0, prefix_cache_queries=300, prefix_cache_hits=140)
    stat_logger.log()
    stat_logger.log()  # no request admitted since the last line
    assert [line.split("Prefix cache hit rate: ")[1] for line in log_lines] == ["25.0%", "90.0%", "0.0%"]
