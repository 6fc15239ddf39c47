"""What the OpenAI wire format's requests and responses share: strict request models, usage, prompt logprobs,
per-request metrics."""

from __future__ import annotations

import time
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_serializer


class RequestModel(BaseModel):
    """A request body, or a part of one: a field it does not know is a 400, and so is a value of another type."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# OpenAI request fields that only label a request for the caller's own bookkeeping: accepted, not used.
METADATA_FIELDS = ("user", "metadata", "store", "service_tier")


class OmitNone(BaseModel):
    """A stream chunk whose vLLM extras (``omitted_when_none``) are left out of its JSON when not set, as vLLM
    leaves them out of its chunks (a whole response carries them as null)."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unset_extras(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None or k not in self.omitted_when_none}


def unix_now() -> int:
    """Seconds since the epoch: a response's ``created``."""
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(OmitNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("prompt_tokens_details",)  # as vLLM: absent unless enabled
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's entry for one token of a prompt: its logprob, its rank (1: the likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token, None for the first: the token's own entry and the top-N, by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class PerRequestMetrics(OmitNone):
    """vLLM's per-request timings (``--enable-per-request-metrics``), for a request of one choice; a timing
    that cannot be known (the mean inter-token latency of a single token) is left out."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ("time_to_first_token_ms", "generation_time_ms",
                                                    "queue_time_ms", "mean_itl_ms", "tokens_per_second")
    time_to_first_token_ms: float | None = None  # first scheduling to the first token
    generation_time_ms: float | None = None  # the first token to the last
    queue_time_ms: float | None = None  # arrival to first scheduling
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None  # generated tokens over first scheduling to the last token
