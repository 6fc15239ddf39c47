"""Prometheus metrics, one registry per app, every name prefixed ``minivllm:``.

Gauges and engine counters (queue sizes, KV pool, prefix cache, preemptions) are read
from ``engine.stats()`` at scrape time by a custom collector, so they are never stale
and cost nothing between scrapes. Token counters, finish reasons and latency histograms
are recorded by the serving code, one ``RequestTimer`` per engine request.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.outputs import EngineOutput

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
        for reason in FINISH_REASONS:
            self.request_success.labels(finished_reason=reason)
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

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latencies and token counts of one engine request, fed with its outputs as they arrive."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival_s = time.monotonic()
        self.last_token_s: float | None = None
        self.queue_time_recorded = False

    def on_output(self, out: EngineOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        if not self.queue_time_recorded and out.queue_time_s is not None:
            m.request_queue_time.observe(out.queue_time_s)
            self.queue_time_recorded = True
        num_new = len(out.new_token_ids)
        if num_new == 0:
            return
        if self.last_token_s is None:
            m.time_to_first_token.observe(now - self.arrival_s)
            m.prompt_tokens.inc(out.num_prompt_tokens)
        else:
            m.inter_token_latency.observe((now - self.last_token_s) / num_new)
        m.generation_tokens.inc(num_new)
        self.last_token_s = now

    def on_finish(self, finish_reason: str) -> None:
        self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrival_s)
        self.metrics.request_success.labels(finished_reason=finish_reason).inc()
