"""What the output processor measures of requests: the per-step figures it hands to a metrics recorder
(the server's Prometheus metrics, named as vLLM's) and the timings of one request (vLLM's per-request
metrics). Times are ``time.monotonic()`` seconds, read in the API server as each step's outputs arrive;
the engine core reports when a request was first scheduled (its queue time, on the same clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.outputs import FinishReason


@dataclass(slots=True)
class FinishedChoice:
    """One finished engine request (a choice), as vLLM's per-request histograms read it. A phase the request
    never reached (aborted while waiting, or before its first token) counts 0 s."""

    finish_reason: FinishReason
    e2e_s: float  # arrival to the end
    prefill_s: float  # first scheduling to the first token
    decode_s: float  # the first token to the last
    inference_s: float  # first scheduling to the last token
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None  # the request's max_tokens parameter
    num_preemptions: int


@dataclass(slots=True)
class StepMetrics:
    """Latencies and token counts seen in one step's outputs (one entry per event), handed to the recorder
    once per step so that per-token bookkeeping is a list append."""

    num_prompt_tokens: int = 0  # of the requests that got their first token
    num_computed_prompt_tokens: int = 0  # of those, the ones computed rather than found in the prefix cache
    num_generation_tokens: int = 0
    queue_times_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    finished: list[FinishedChoice] = field(default_factory=list)
    # Per prompt whose choices have all finished: its n, and the most tokens one of its choices generated.
    params_n: list[int] = field(default_factory=list)
    max_generation_tokens: list[int] = field(default_factory=list)

    @property
    def num_iteration_tokens(self) -> int:
        """vLLM's tokens of the step: prompt tokens computed for the requests that got their first token in it,
        plus the tokens it generated (the first token of a prefill included)."""
        return self.num_computed_prompt_tokens + self.num_generation_tokens


class MetricsRecorder(Protocol):
    """Where the processor's per-step metrics go (the server's Prometheus metrics)."""

    def record(self, step: StepMetrics) -> None: ...

    def record_delivery(self, delay_s: float, processing_s: float) -> None:
        """How long a step's outputs waited between the engine core and the API server, and how
        long the API server took to handle them."""

    def record_admission_rejection(self, reason: str) -> None:
        """A request refused before it reached the engine because the waiting queue was full."""


@dataclass(slots=True)
class ChoiceClock:
    """When one choice's events happened; None until they have."""

    arrival_s: float
    scheduled_s: float | None = None  # first scheduled in the engine core
    first_token_s: float | None = None
    last_token_s: float | None = None

    def finished(self, reason: FinishReason, now: float, num_prompt_tokens: int, num_generation_tokens: int,
                 max_tokens: int | None, num_preemptions: int) -> FinishedChoice:
        scheduled = self.scheduled_s if self.scheduled_s is not None else now
        first = self.first_token_s if self.first_token_s is not None else scheduled
        last = self.last_token_s if self.last_token_s is not None else first
        return FinishedChoice(reason, now - self.arrival_s, max(first - scheduled, 0.0), last - first,
                              max(last - scheduled, 0.0), num_prompt_tokens, num_generation_tokens, max_tokens,
                              num_preemptions)


@dataclass(frozen=True)
class RequestTimings:
    """vLLM's per-request metrics of a request of one choice, in seconds; None where a timing cannot be known
    (a request that never got a token has no time to first token)."""

    queue_s: float | None
    time_to_first_token_s: float | None  # from first scheduling, as vLLM's
    generation_s: float | None  # the first token to the last
    mean_inter_token_s: float | None  # needs two tokens
    tokens_per_second: float | None  # generated tokens over first scheduling to the last token

    @classmethod
    def of(cls, clock: ChoiceClock, num_generation_tokens: int) -> RequestTimings:
        scheduled, first, last = clock.scheduled_s, clock.first_token_s, clock.last_token_s
        queue = None if scheduled is None else scheduled - clock.arrival_s
        ttft = None if scheduled is None or first is None else first - scheduled
        generation = None if first is None or last is None else last - first
        itl = generation / (num_generation_tokens - 1) if generation is not None and num_generation_tokens > 1 else None
        rate = None
        if scheduled is not None and last is not None and last > scheduled:
            rate = num_generation_tokens / (last - scheduled)
        return cls(queue, ttft, generation, itl, rate)
