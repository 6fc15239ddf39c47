"""/v1/completions: the request, and the whole response and stream chunks."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from engine.sampling_params import SamplingParamsError
from server.protocol.common import OmitNone, PerRequestMetrics, PromptLogprobs, UsageInfo, unix_now
from server.protocol.sampling import SamplingRequest


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's prompt embeddings (base64 torch tensors, behind its --enable-prompt-embeds): refused, a 400 naming them.
    prompt_embeds: str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None

    def check_prompt(self) -> None:
        """A prompt is given, as vLLM asks (an empty ``prompt_embeds`` list gives none), and not as embeddings."""
        if self.prompt_embeds:
            raise SamplingParamsError("prompt_embeds are not supported: minivllm takes prompts as text or token ids "
                                      "(vLLM serves them with --enable-prompt-embeds; minivllm has no such mode)",
                                      "prompt_embeds")
        if self.prompt is None or self.prompt == "":
            raise SamplingParamsError("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """A whole choice: vLLM's extras are always there, null when not asked for (clients read them as
    attributes)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop_token_ids entry that ended it
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs, or echo with logprobs
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionStreamChoice(OmitNone):
    """A chunk's choice: vLLM's extras only where they are set."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "token_ids", "prompt_logprobs")
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in a choice's first chunk
    token_ids: list[int] | None = None  # with return_token_ids: the chunk's tokens


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    metrics: PerRequestMetrics | None = None  # with --enable-per-request-metrics


class CompletionChunk(OmitNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("metrics",)
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    metrics: PerRequestMetrics | None = None  # with --enable-per-request-metrics: on the usage chunk
