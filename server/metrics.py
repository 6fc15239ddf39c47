"""Prometheus metrics, one registry per app, every name prefixed ``minivllm:`` (``--metrics-prefix``).

The names after the prefix are vLLM's, so ``--metrics-prefix vllm:`` lets vLLM's Grafana
dashboards and alerts read this server.

Gauges and engine counters (queue sizes, KV pool, prefix cache, preemptions) are read
from ``engine.stats()`` (the engine core's latest snapshot) at scrape time by a custom
collector, so they cost nothing between scrapes. Token counters, finish reasons and
latency histograms are recorded by the output processor as it handles each step.
"""

from __future__ import annotations

import time

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.frontend.request_metrics import StepMetrics

PREFIX = "minivllm:"  # the default
FINISH_REASONS = ("stop", "length", "abort")
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0, 160.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5)

_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)  # vLLM's: the first holds the never-preempted too
# vLLM's reasons for refusing a request before it reaches the engine (minivllm has the first: --max-waiting-requests).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

# What a step's outputs may wait for and take in the API server: tens of microseconds to, at worst, seconds.
_DELIVERY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                       1.0, 2.0, 4.0)


class EngineStatsCollector(Collector):
    """Reads the engine's latest stats snapshot at scrape time."""

    def __init__(self, engine, prefix: str = PREFIX):
        self.engine = engine
        self.prefix = prefix

    def collect(self):
        PREFIX = self.prefix  # noqa: N806 - the module default, overridden
        alive = self.engine.dead_error is None
        yield GaugeMetricFamily(PREFIX + "engine_up", "1 while the engine runs; 0 once it has failed (the other "
                                "engine figures are then no longer reported).", value=1 if alive else 0)
        if not alive:
            return
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
        by_reason = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason", "Waiting requests, by why they "
                                      "wait: capacity (seats or KV blocks) or deferred (a grammar compiling).",
                                      labels=["reason"])
        by_reason.add_metric(["capacity"], stats.num_waiting - stats.num_waiting_for_grammar)
        by_reason.add_metric(["deferred"], stats.num_waiting_for_grammar)
        yield by_reason
        config = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's configuration (value 1); "
                                   "max concurrency: how many requests of max_model_len tokens the pool holds.",
                                   labels=["block_size", "cache_dtype", "num_gpu_blocks", "kv_cache_size_tokens",
                                           "kv_cache_max_concurrency"])
        cache_dtype = self.engine.config.kv_cache_dtype if getattr(self.engine, "config", None) else "auto"
        size_tokens = kv.num_total_blocks * kv.block_size
        max_model_len = self.engine.model.max_model_len
        config.add_metric([str(kv.block_size), cache_dtype, str(kv.num_total_blocks), str(size_tokens),
                           f"{size_tokens / max_model_len:.2f}"], 1)
        yield config
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.prefix_cache_hits),
            ("num_preemptions", "Requests preempted to free KV cache blocks.", stats.num_preemptions),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield from _host_tier_metrics(PREFIX, kv.host, stats.kv_transfers)
        if stats.spec_decode is not None:
            yield from _spec_decode_metrics(PREFIX, stats.spec_decode)
        if stats.lora is not None:
            yield from _lora_metrics(PREFIX, stats.lora)
        steps = CounterMetricFamily(PREFIX + "engine_steps", "Forward passes, by how they ran: a captured decode "
                                    "graph, a captured mixed-step graph (decodes with prefill chunks), or eagerly "
                                    "(larger steps, steps with images or prompt logprobs, the CPU, --enforce-eager).",
                                    labels=["kind"])
        for kind, value in stats.num_steps_by_kind.items():
            steps.add_metric([kind], value)
        yield steps
        if stats.encoder is not None:  # a model that takes images
            encoder = stats.encoder
            for name, doc, value in [
                ("encoder_cache_tokens_total", "Image embeddings the encoder cache may hold at once.",
                 encoder.capacity_tokens),
                ("encoder_cache_tokens_used", "Image embeddings in the encoder cache.", encoder.used_tokens),
                ("encoder_cache_images", "Images whose embeddings the encoder cache holds.", encoder.num_images),
            ]:
                yield GaugeMetricFamily(PREFIX + name, doc, value=value)
            yield CounterMetricFamily(PREFIX + "encoder_images_encoded", "Images run through the vision encoder.",
                                      value=encoder.num_encoded)
            yield CounterMetricFamily(PREFIX + "encoder_cache_reuses", "Times a request found an image it needed "
                                      "already encoded (another request's, or its own before a preemption).",
                                      value=encoder.num_reused)


def _spec_decode_metrics(prefix: str, spec):
    """Speculative decoding (``--speculative-config``), with vLLM's names."""
    for name, doc, value in [
        ("spec_decode_num_drafts", "Requests' sets of proposed tokens verified.", spec.num_drafts),
        ("spec_decode_num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens),
    ]:
        yield CounterMetricFamily(prefix + name, doc, value=value)
    per_position = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos", "Proposed tokens "
                                       "accepted, by their position among a request's proposals.", labels=["position"])
    for position, value in enumerate(spec.accepted_per_position):
        per_position.add_metric([str(position)], value)
    yield per_position


def _lora_metrics(prefix: str, lora):
    """LoRA adapters (``--enable-lora``). vLLM's ``lora_requests_info``: the adapters of running and of waiting
    requests as comma-separated labels (sorted), its value the time of the scrape (dashboards take the latest
    series); then the device slots' traffic."""
    info = GaugeMetricFamily(prefix + "lora_requests_info", "Running stats on LoRA requests: the adapters of running "
                             "and of waiting requests, and the most adapters in one step.",
                             labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    def names(counts: dict[str, int]) -> str:
        return ",".join(sorted(name for name, n in counts.items() if n))

    info.add_metric([names(lora.running), names(lora.waiting), str(lora.max_loras)], time.time())
    yield info
    yield CounterMetricFamily(prefix + "lora_adapter_loads", "LoRA adapters copied into a device slot.",
                              value=lora.num_loads)
    yield CounterMetricFamily(prefix + "lora_adapter_evictions", "LoRA adapters that left a device slot for another "
                              "adapter.", value=lora.num_evictions)


def _host_tier_metrics(prefix: str, host, transfers):
    """The host KV tier (``--kv-offloading-size``): zeros while it is off, so dashboards need no special case."""
    PREFIX = prefix  # noqa: N806 - the module default, overridden
    yield GaugeMetricFamily(PREFIX + "kv_host_blocks_total", "KV blocks of the host tier (0: no host tier).",
                            value=host.num_total_blocks if host else 0)
    yield GaugeMetricFamily(PREFIX + "kv_host_blocks_used", "Host tier blocks holding KV: cached, or held for "
                            "swapped-out requests and planned copies.", value=host.num_used_blocks if host else 0)
    for name, doc, value in [
        ("external_prefix_cache_queries", "Prompt tokens looked up in the host tier (those the device pool did not "
         "have).", host.external_prefix_cache_queries if host else 0),
        ("external_prefix_cache_hits", "Prompt tokens found in the host tier and copied back instead of computed.",
         host.external_prefix_cache_hits if host else 0),
        ("kv_swap_out_blocks", "KV blocks of requests preempted by swap, held in the host tier (copied there, or "
         "there already); kv_offload_bytes_total counts the copies.", host.num_swapped_out_blocks if host else 0),
        ("kv_swap_in_blocks", "KV blocks swapped-out requests resumed with (copied back, or still cached on the "
         "device).", host.num_swapped_in_blocks if host else 0),
    ]:
        yield CounterMetricFamily(PREFIX + name, doc, value=value)
    moved = CounterMetricFamily(PREFIX + "kv_offload_bytes", "Bytes copied between the device KV pool and the host "
                                "tier (rank 0's share under tensor parallelism).", labels=["direction"])
    seconds = CounterMetricFamily(PREFIX + "kv_offload_seconds", "Device time of those copies (CPU time on the "
                                  "CPU), counted once they have finished.", labels=["direction"])
    for direction in ("to_host", "to_device"):
        moved.add_metric([direction], getattr(transfers, f"bytes_{direction}") if transfers else 0)
        seconds.add_metric([direction], getattr(transfers, f"seconds_{direction}") if transfers else 0.0)
    yield moved
    yield seconds


class BatchHistogram(Collector):
    """A Prometheus histogram fed a whole step's observations at once: one numpy pass per step
    instead of a locked ``observe`` per token (256 of them per step at full batch)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name = name
        self.documentation = documentation
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # the last bucket is +Inf
        self.sum = 0.0
        registry.register(self)

    def observe_many(self, values: list[float]) -> None:
        if not values:
            return
        x = np.asarray(values, dtype=np.float64)
        # A value lands in the first bucket whose upper bound is >= it (Prometheus' "le").
        self.counts += np.bincount(np.searchsorted(self.bounds, x, side="left"), minlength=len(self.counts))
        self.sum += float(x.sum())

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def collect(self):
        cumulative = np.cumsum(self.counts)
        buckets = [(floatToGoString(b), int(c)) for b, c in zip(self.bounds, cumulative)]
        buckets.append(("+Inf", int(cumulative[-1])))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)


class ServerMetrics:
    """The app's registry: the engine collector plus what the output processor records."""

    def __init__(self, engine, prefix: str = PREFIX):
        PREFIX = prefix  # noqa: N806 - the module default, overridden
        self.prefix = prefix
        self.registry = reg = CollectorRegistry()
        reg.register(EngineStatsCollector(engine, prefix))
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=reg)
        self.request_success = Counter(PREFIX + "request_success", "Finished engine requests, by finish reason.",
                                       ["finished_reason"], registry=reg)
        self._finished = {reason: self.request_success.labels(finished_reason=reason) for reason in FINISH_REASONS}
        self.time_to_first_token = BatchHistogram(PREFIX + "time_to_first_token_seconds", "Time to the first token.",
                                                  _LATENCY_BUCKETS_S, reg)
        self.inter_token_latency = BatchHistogram(PREFIX + "inter_token_latency_seconds",
                                                  "Time between output tokens.", _ITL_BUCKETS_S, reg)
        self.e2e_request_latency = BatchHistogram(PREFIX + "e2e_request_latency_seconds",
                                                  "Time from arrival to the last token.", _LATENCY_BUCKETS_S, reg)
        self.request_queue_time = BatchHistogram(PREFIX + "request_queue_time_seconds",
                                                 "Time from arrival to first scheduling.", _LATENCY_BUCKETS_S, reg)
        self.iteration_tokens = BatchHistogram(PREFIX + "iteration_tokens_total",
                                               "Tokens per engine step with outputs: prompt tokens computed for the "
                                               "requests that got their first token, and tokens generated.",
                                               _ITERATION_TOKEN_BUCKETS, reg)
        self.admission_rejections = Counter(PREFIX + "admission_rejections", "Requests refused before they reached "
                                            "the engine, by reason (max_num_queued_reqs: --max-waiting-requests).",
                                            ["reason"], registry=reg)
        self._rejected = {reason: self.admission_rejections.labels(reason=reason) for reason in ADMISSION_REASONS}
        self._add_request_histograms(engine.model.max_model_len)
        self.output_delay = BatchHistogram(
            PREFIX + "engine_output_delay_seconds",
            "Time from the engine core sending a step's outputs to the API server taking them up.",
            _DELIVERY_BUCKETS_S, reg)
        self.output_processing = BatchHistogram(
            PREFIX + "output_processing_seconds",
            "API server time to handle one step's outputs (detokenization, stop strings, routing).",
            _DELIVERY_BUCKETS_S, reg)

    def _add_request_histograms(self, max_model_len: int) -> None:
        """vLLM's histograms of finished requests: sizes, parameters, and the time spent in each phase."""
        prefix, reg = self.prefix, self.registry
        token_buckets = tuple(_one_two_five(max_model_len))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> BatchHistogram:
            return BatchHistogram(prefix + name, doc, buckets, reg)

        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens generated by each finished request.", token_buckets)
        self.request_max_tokens = histogram("request_params_max_tokens", "The max_tokens parameter of each finished "
                                            "request that set one.", token_buckets)
        self.request_params_n = histogram("request_params_n", "The n parameter, once per prompt.", _PARAMS_N_BUCKETS)
        self.request_max_generation_tokens = histogram("request_max_num_generation_tokens", "Per prompt, the most "
                                                       "tokens one of its n choices generated.", token_buckets)
        self.request_inference_time = histogram("request_inference_time_seconds", "Time from first scheduling to "
                                                "the last token.", _LATENCY_BUCKETS_S)
        self.request_prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduling to the "
                                              "first token.", _LATENCY_BUCKETS_S)
        self.request_decode_time = histogram("request_decode_time_seconds", "Time from the first token to the last.",
                                             _LATENCY_BUCKETS_S)
        self.request_preemptions = histogram("request_num_preemptions", "Times each finished request was preempted.",
                                             _PREEMPTION_BUCKETS)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def record_admission_rejection(self, reason: str) -> None:
        self._rejected[reason].inc()

    def record_delivery(self, delay_s: float, processing_s: float) -> None:
        self.output_delay.observe_many([delay_s])
        self.output_processing.observe_many([processing_s])

    def record(self, step: StepMetrics) -> None:
        """The output processor's MetricsRecorder: once per engine step."""
        if step.num_generation_tokens:
            self.generation_tokens.inc(step.num_generation_tokens)
        if step.num_prompt_tokens:
            self.prompt_tokens.inc(step.num_prompt_tokens)

        if step.num_iteration_tokens:
            self.iteration_tokens.observe_many([step.num_iteration_tokens])
        self.time_to_first_token.observe_many(step.ttfts_s)
        self.inter_token_latency.observe_many(step.inter_token_s)
        self.request_queue_time.observe_many(step.queue_times_s)
        self.request_params_n.observe_many(step.params_n)
        self.request_max_generation_tokens.observe_many(step.max_generation_tokens)
        if step.finished:
            self._record_finished(step)

    def _record_finished(self, step: StepMetrics) -> None:
        done = step.finished
        for histogram, values in (
            (self.e2e_request_latency, [f.e2e_s for f in done]),
            (self.request_prefill_time, [f.prefill_s for f in done]),
            (self.request_decode_time, [f.decode_s for f in done]),
            (self.request_inference_time, [f.inference_s for f in done]),
            (self.request_prompt_tokens, [f.num_prompt_tokens for f in done]),
            (self.request_generation_tokens, [f.num_generation_tokens for f in done]),
            (self.request_max_tokens, [f.max_tokens for f in done if f.max_tokens]),
            (self.request_preemptions, [f.num_preemptions for f in done]),
        ):
            histogram.observe_many(values)
        for finished in done:
            self._finished[finished.finish_reason.value].inc()


def _one_two_five(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets of token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10
