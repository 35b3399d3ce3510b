"""Prometheus metrics under vLLM's names (prefix `pagellm:`), in a registry of their own per server.

Scheduler gauges (running, waiting, KV usage and blocks, token efficiency, the host tier) and cumulative counters
(preemptions, prefix cache queries and hits, swapped blocks) are read from the engines' latest scheduler snapshots
at scrape time; token counters and latency histograms are recorded from IterationStats. Every series carries an
`engine` label, as vLLM's do: the data-parallel replica ("0" without data parallelism). `request_success_total` also
carries the API `endpoint` the request came through (its path; a /v1/batches job's lines count as /v1/batches).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase

FINISH_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]


def _host_kv_cache_usage(stats: SchedulerStats) -> float:
    return stats.num_used_host_blocks / stats.num_host_blocks if stats.num_host_blocks else 0.0


# (name, documentation, value from the snapshot)
_SchedulerMetric = tuple[str, str, Callable[[SchedulerStats], float]]
_SCHEDULER_GAUGES: tuple[_SchedulerMetric, ...] = (
    ("pagellm:num_requests_running", "Number of requests in model execution batches.", lambda s: s.num_running),
    ("pagellm:num_requests_waiting", "Number of requests waiting to be processed.", lambda s: s.num_waiting),
    ("pagellm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_cache_usage),
    ("pagellm:kv_cache_used_blocks", "KV-cache blocks held by requests.", lambda s: s.num_used_blocks),
    ("pagellm:kv_cache_num_blocks", "KV-cache blocks in the pool.", lambda s: s.num_blocks),
    ("pagellm:kv_cache_token_efficiency",
     "Tokens stored in the KV-cache blocks requests hold, over their capacity (shared blocks counted once).",
     lambda s: s.kv_cache_token_efficiency),
    ("pagellm:host_kv_cache_usage_perc", "Host (CPU) KV-cache tier usage. 1 means 100 percent usage.",
     _host_kv_cache_usage),
    ("pagellm:host_kv_cache_used_blocks", "Host KV-cache tier blocks in use.", lambda s: s.num_used_host_blocks),
    ("pagellm:host_kv_cache_num_blocks", "Host KV-cache tier blocks in the pool.", lambda s: s.num_host_blocks),
)
_SCHEDULER_COUNTERS: tuple[_SchedulerMetric, ...] = (
    ("pagellm:num_preemptions", "Cumulative number of preemptions.", lambda s: s.num_preemptions_total),
    ("pagellm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens (new requests; preempted ones are counted apart).",
     lambda s: s.prefix_cache_queries),
    ("pagellm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens (new requests).",
     lambda s: s.prefix_cache_hits),
    ("pagellm:prefix_cache_preempted_queries",
     "Prefix cache queries of preempted requests coming back, in terms of number of queried tokens.",
     lambda s: s.prefix_cache_preempted_queries),
    ("pagellm:prefix_cache_preempted_hits",
     "Prefix cache hits of preempted requests coming back, in terms of number of cached tokens.",
     lambda s: s.prefix_cache_preempted_hits),
    ("pagellm:num_swapped_out_blocks", "Cumulative number of KV blocks copied out to the host tier.",
     lambda s: s.num_swapped_out_blocks_total),
    ("pagellm:num_swapped_in_blocks", "Cumulative number of KV blocks copied back in from the host tier.",
     lambda s: s.num_swapped_in_blocks_total),
    ("pagellm:spec_decode_num_drafts", "Number of spec decoding drafts.", lambda s: s.spec_decode_num_drafts),
    ("pagellm:spec_decode_num_draft_tokens", "Number of draft tokens.", lambda s: s.spec_decode_num_draft_tokens),
    ("pagellm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
     lambda s: s.spec_decode_num_accepted_tokens),
)


class _SchedulerCollector(Collector):
    def __init__(self, model_name: str, replica_stats: Callable[[], list[SchedulerStats]]) -> None:
        self._model_name = model_name
        self._replica_stats = replica_stats

    def collect(self) -> Iterator[Metric]:
        replicas = self._replica_stats()
        for family, metrics in ((GaugeMetricFamily, _SCHEDULER_GAUGES), (CounterMetricFamily, _SCHEDULER_COUNTERS)):
            for name, documentation, value in metrics:
                metric = family(name, documentation, labels=["model_name", "engine"])
                for engine, stats in enumerate(replicas):
                    metric.add_metric([self._model_name, str(engine)], value(stats))
                yield metric
        per_pos = CounterMetricFamily("pagellm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=["model_name", "engine", "position"])
        for engine, stats in enumerate(replicas):
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([self._model_name, str(engine), str(position)], count)
        yield per_pos


class _PerEngine:
    """One child of a labelled metric per engine, created up front so every series is exported from the start."""

    def __init__(self, metric: Counter | Histogram, model_name: str, num_engines: int) -> None:
        self._children = [metric.labels(model_name=model_name, engine=str(i)) for i in range(num_engines)]

    def __getitem__(self, engine: int):
        return self._children[engine]


class PrometheusStatLogger(StatLoggerBase):
    """`cache_config_info`: the KV cache's settings, exported as the labels of a gauge set to 1 (vLLM's
    `cache_config_info`), so dashboards can tell the block size and the cache's element type."""

    def __init__(self, model_name: str, replica_stats: Callable[[], list[SchedulerStats]],
                 cache_config_info: dict[str, str] | None = None, endpoints: tuple[str, ...] = ()) -> None:
        self._model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(model_name, replica_stats))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds, open fds
        if cache_config_info:
            Gauge("pagellm:cache_config_info", "Information of the KV cache's configuration.",
                  ["model_name", *cache_config_info], registry=self.registry).labels(
                model_name=model_name, **cache_config_info).set(1)
        num_engines = len(replica_stats())
        labels = ["model_name", "engine"]

        def counter(name: str, documentation: str) -> _PerEngine:
            return _PerEngine(Counter(name, documentation, labels, registry=self.registry), model_name, num_engines)

        def histogram(name: str, documentation: str, buckets: list[float]) -> _PerEngine:
            return _PerEngine(Histogram(name, documentation, labels, buckets=buckets, registry=self.registry),
                              model_name, num_engines)

        self.prompt_tokens = counter("pagellm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("pagellm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter("pagellm:request_success", "Count of successfully processed requests.",
                                       [*labels, "finished_reason", "endpoint"], registry=self.registry)
        for engine in range(num_engines):  # every reason of every endpoint is exported from the start, at 0
            for reason in FINISH_REASONS:
                for endpoint in endpoints:
                    self.request_success.labels(model_name=model_name, engine=str(engine), finished_reason=reason,
                                                endpoint=endpoint)
        self.time_to_first_token = histogram("pagellm:time_to_first_token_seconds",
                                              "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("pagellm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("pagellm:e2e_request_latency_seconds",
                                             "Histogram of end to end request latency in seconds.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "pagellm:request_queue_time_seconds",
            "Histogram of time requests spent waiting before they were first scheduled, in seconds.",
            _REQUEST_BUCKETS)

    def record(self, iteration: IterationStats) -> None:
        engine = iteration.engine_index
        self.prompt_tokens[engine].inc(iteration.num_prompt_tokens)
        self.generation_tokens[engine].inc(iteration.num_generation_tokens)
        for ttft in iteration.time_to_first_tokens:
            self.time_to_first_token[engine].observe(ttft)
        for itl in iteration.inter_token_latencies:
            self.inter_token_latency[engine].observe(itl)
        for finished in iteration.finished_requests:
            self.request_success.labels(model_name=self._model_name, engine=str(engine),
                                        finished_reason=finished.finish_reason, endpoint=finished.endpoint).inc()
            self.e2e_request_latency[engine].observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.request_queue_time[engine].observe(finished.queue_time)
