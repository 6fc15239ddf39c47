"""From per-request results to the benchmark's numbers: throughput, latency percentiles, goodput.

Latencies are reported in milliseconds. Throughputs divide by the run's duration (first send
to last response), which is at least every request's end-to-end latency.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from serve_client import RequestResult

LATENCY_NAMES = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)",
                 "itl": "Inter-token latency", "e2el": "End-to-end latency"}
SLO_NAMES = ("ttft", "tpot", "e2el")  # what --goodput accepts


@dataclass
class LatencyStats:
    """Milliseconds. All zero when there is no sample."""

    mean: float = 0.0
    median: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    min: float = 0.0
    max: float = 0.0
    std: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, samples_ms: list[float]) -> LatencyStats:
        if not samples_ms:
            return cls()
        x = np.asarray(samples_ms, dtype=np.float64)
        p50, p90, p99 = np.percentile(x, [50, 90, 99])
        return cls(mean=float(x.mean()), median=float(p50), p90=float(p90), p99=float(p99), min=float(x.min()),
                   max=float(x.max()), std=float(x.std()), count=int(x.size))


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests/s
    input_throughput: float  # prompt tokens/s
    output_throughput: float  # generated tokens/s
    total_token_throughput: float
    good_requests: int | None  # None: no SLO given
    request_goodput: float | None  # requests meeting every SLO, per second
    latency_ms: dict[str, LatencyStats]  # "ttft", "tpot", "itl", "e2el"

    def to_dict(self) -> dict:
        return asdict(self)


def latency_samples_ms(results: list[RequestResult]) -> dict[str, list[float]]:
    """Every latency kind of the successful requests, in ms (ITL: every gap of every request)."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft_s * 1000 for r in ok],
        "tpot": [r.tpot_s * 1000 for r in ok if r.completion_tokens > 1],
        "itl": [gap * 1000 for r in ok for gap in r.itl_s],
        "e2el": [r.latency_s * 1000 for r in ok],
    }


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {', '.join(SLO_NAMES)}; got {spec!r}")
        if float(value) <= 0:
            raise ValueError(f"--goodput {name} must be positive, got {value}")
        slos[name] = float(value)
    return slos


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    measured_ms = {"ttft": result.ttft_s * 1000, "tpot": result.tpot_s * 1000, "e2el": result.latency_s * 1000}
    return result.success and all(measured_ms[name] <= limit for name, limit in slos_ms.items())


def compute_metrics(results: list[RequestResult], duration_s: float, slos_ms: dict[str, float]) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    good = sum(meets_slos(r, slos_ms) for r in ok) if slos_ms else None
    samples = latency_samples_ms(results)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        input_throughput=input_tokens / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        good_requests=good,
        request_goodput=None if good is None else good / duration_s,
        latency_ms={name: LatencyStats.of(values) for name, values in samples.items()},
    )


def output_token_timeline(results: list[RequestResult], t0_s: float, duration_s: float,
                          bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per second in ``bin_s`` bins: (bin edges in s since the start, tokens/s of each bin).

    A chunk may carry several tokens (the server holds text back until it decodes cleanly), so
    each request's usage count is spread evenly over its chunks: the bins add up to the usage total.
    """
    duration_s = max(duration_s, 1e-9)
    # The last bin ends at the run's end and is 0.5 to 1.5 bins wide, so a short tail does not spike.
    edges = np.append(np.arange(0.0, max(duration_s - bin_s / 2, 1e-12), bin_s), duration_s)
    times, weights = [], []
    for r in results:
        if r.success and r.chunk_times_s:
            times += [t - t0_s for t in r.chunk_times_s]
            weights += [r.completion_tokens / len(r.chunk_times_s)] * len(r.chunk_times_s)
    tokens, _ = np.histogram(times, bins=edges, weights=weights)
    return edges, tokens / np.diff(edges)


# ---------------------------------------------------------------------------- table


def format_table(m: BenchmarkMetrics, slos_ms: dict[str, float]) -> str:
    width = 50
    rows = [
        ("Successful requests:", m.completed),
        ("Failed requests:", m.failed),
        ("Benchmark duration (s):", m.duration_s),
        ("Total input tokens:", m.total_input_tokens),
        ("Total generated tokens:", m.total_output_tokens),
        ("Request throughput (req/s):", m.request_throughput),
    ]
    if m.request_goodput is not None:
        slo_text = " ".join(f"{k}<={v:g}ms" for k, v in slos_ms.items())
        rows += [(f"Good requests ({slo_text}):", m.good_requests), ("Request goodput (req/s):", m.request_goodput)]
    rows += [
        ("Input token throughput (tok/s):", m.input_throughput),
        ("Output token throughput (tok/s):", m.output_throughput),
        ("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    lines = [" Serving Benchmark Result ".center(width, "=")]
    lines += [_row(label, value) for label, value in rows]
    for key, title in LATENCY_NAMES.items():
        stats = m.latency_ms[key]
        lines.append(f" {title} ".center(width, "-"))
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(_row(f"{stat.capitalize()} {key.upper()} (ms):", getattr(stats, stat)))
    lines.append("=" * width)
    return "\n".join(lines)


def _row(label: str, value: float | int) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:>10}"
