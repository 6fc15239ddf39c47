"""Prometheus metrics, one registry per app, every name prefixed ``minivllm:``.

Gauges and engine counters (queue sizes, KV pool, prefix cache, preemptions) are read
from ``engine.stats()`` (the engine core's latest snapshot) at scrape time by a custom
collector, so they cost nothing between scrapes. Token counters, finish reasons and
latency histograms are recorded by the output processor as it handles each step.
"""

from __future__ import annotations


from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.outputs import FinishReason

PREFIX = "minivllm:"
FINISH_REASONS = ("stop", "length", "abort")
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0, 160.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5)


class EngineStatsCollector(Collector):
    """Reads the engine's latest stats snapshot at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        kv = stats.kv
        gauges = [
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_blocks_total", "KV cache blocks in the pool.", kv.num_total_blocks),
            ("kv_cache_blocks_free", "KV cache blocks not referenced by any request (cached or not).",
             kv.num_free_blocks),
            ("kv_cache_blocks_used", "KV cache blocks referenced by at least one request.", kv.num_used_blocks),
            ("kv_cache_blocks_cached", "KV cache blocks findable by prefix hash (in use or free).",
             kv.num_cached_blocks),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", kv.usage),
            ("kv_cache_fragmentation_ratio", "Allocated but unused token slots over allocated slots.",
             kv.fragmentation),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.prefix_cache_hits),
            ("num_preemptions", "Requests preempted to free KV cache blocks.", stats.num_preemptions),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    """The app's registry: the engine collector plus what the serving code records."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(engine))
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=reg)
        self.request_success = Counter(PREFIX + "request_success", "Finished engine requests, by finish reason.",
                                       ["finished_reason"], registry=reg)
        self._finished = {reason: self.request_success.labels(finished_reason=reason) for reason in FINISH_REASONS}
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first token.",
                                             buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                                             buckets=_ITL_BUCKETS_S, registry=reg)
        self.e2e_request_latency = Histogram(PREFIX + "e2e_request_latency_seconds",
                                             "Time from arrival to the last token.", buckets=_LATENCY_BUCKETS_S,
                                             registry=reg)
        self.request_queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                            "Time from arrival to first scheduling.", buckets=_LATENCY_BUCKETS_S,
                                            registry=reg)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # The output processor's MetricsRecorder: called for every engine request of every step,
    # so each is a counter increment or a histogram observation, nothing more.

    def observe_queue_time(self, seconds: float) -> None:
        self.request_queue_time.observe(seconds)

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.time_to_first_token.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_tokens(self, num_tokens: int, inter_token_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if inter_token_s is not None:
            self.inter_token_latency.observe(inter_token_s)

    def observe_finish(self, reason: FinishReason, e2e_s: float) -> None:
        self.e2e_request_latency.observe(e2e_s)
        self._finished[reason.value].inc()
