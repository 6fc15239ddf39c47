"""What completions and chat share: the serving context, admission, and the two ways to answer.

    request ─> check model ─> tokenize ─> SamplingParams ─> admit (check every prompt
    against the model before anything starts) ─> Generation ─┬─> collect() ─> one JSON body
                                                              └─> chunks ─> sse_stream() ─> SSE

A request's ``model`` names the served model or one of its LoRA adapters (server/lora.py); admission sets the
adapter it runs under (``SamplingParams.lora_request``), and its responses name that model back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request, Response
from pydantic import BaseModel

from engine.frontend.async_engine import AsyncEngine
from engine.frontend.output_processor import Usage
from engine.loading.model_info import ModelInfo
from engine.lora.request import LoRARequest
from engine.outputs import FinishReason, Logprobs
from engine.sampling_params import SamplingParams
from server.chat_templates import TemplateRunner
from server.errors import INVALID_REQUEST, APIError, bad_request
from server.generation import Generation
from server.limits import ServerLimits
from server.lora import LoRARegistry
from server.media import MediaLimits
from server.metrics import ServerMetrics
from server.protocol import PerRequestMetrics, PromptLogprob, PromptLogprobs, PromptTokensDetails, UsageInfo
from server.streaming import (
    DONE,
    ClientDisconnected,
    SSEResponse,
    client_closed_response,
    events_then_error,
    run_until_disconnected,
    sse_event,
)
from server.template_sandbox import TemplateLimits, TemplateTimeout
from server.text_bound import TextBound
from server.tokenization import TokenizedPrompt, check_unicode, token_text

logger = logging.getLogger("minivllm.server")

LOGPROB_FLOOR = -9999.0  # JSON has no -inf
# The most logprob entries one response may carry (a token's own and its top-N count one each, at every prompt and
# generated position of every choice): about 70 MB of JSON, and some 0.5 GB of the API server's memory to build.
# Whole-vocabulary logprobs (-1, under --max-logprobs -1) fit for a few dozen positions of a 50k-token vocabulary.


@dataclass(frozen=True)
class ServedModel:
    """The model facts handlers read: what clients call it, and what the engine reported at start-up."""

    name: str
    info: ModelInfo
    tokenizer: object | None  # the Hugging Face tokenizer, or None for a model without one
    tool_parser: str = "hermes"  # server/tool_parsers.py: how tool calls are read out of the text
    reasoning_parser: str | None = None  # server/reasoning.py: None when the thinking is not split off
    # What its prompts may carry: ("text",), or ("text", "image") for a model that takes images.
    input_modalities: tuple[str, ...] = ("text",)
    # engine.multimodal.MultiModalProcessor of a model that takes images: the images' pixels and tokens.
    image_processor: object | None = None

    @property
    def accepts_images(self) -> bool:
        return "image" in self.input_modalities

    @property
    def chat_template(self) -> str | None:
        """The chat template of a request that gives none: a model that takes images has its processor's, the one
        that renders image parts (as Hugging Face's ``processor.apply_chat_template`` does); None: the tokenizer's."""
        return getattr(self.image_processor, "chat_template", None)

    @property
    def path(self) -> str:
        return self.info.model_path

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size


@dataclass
class ServingContext:
    """Everything a handler needs: the engine, the served model and its LoRA adapters, metrics, and the API key."""

    engine: AsyncEngine
    model: ServedModel
    metrics: ServerMetrics
    limits: ServerLimits = field(default_factory=ServerLimits)
    media: MediaLimits = field(default_factory=MediaLimits)  # what images may be, and where they may come from
    loras: LoRARegistry | None = None  # the adapters requests may name (None: none, LoRA off)
    api_key: str | None = None
    force_include_usage: bool = False  # --enable-force-include-usage: usage on every chunk and a usage chunk last
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: a request's own field wins
    per_request_metrics: bool = False  # --enable-per-request-metrics: a response's (or usage chunk's) timings
    # --trust-request-chat-template: requests may bring a chat template of their own (else a 400, as vLLM)
    trust_request_chat_template: bool = False
    # Tokenization runs here, off the event loop: one thread, so the tokenizer is never used by two
    # encodes at once; text is bounded (text_bound) before it gets here, so no encode holds it for long.
    _tokenizer_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minivllm-tokenizer"),
        init=False, repr=False)
    # Chat templates render in threads of their own, each within its bounds (server/chat_templates.py); templates
    # that requests bring have slots of their own, so that they can hold up only each other.
    _templates: TemplateRunner = field(default_factory=lambda: TemplateRunner(8), init=False, repr=False)
    _request_templates: TemplateRunner = field(default_factory=lambda: TemplateRunner(2), init=False, repr=False)
    text_bound: TextBound = field(init=False)  # the characters a prompt may have before it is tokenized

    def __post_init__(self) -> None:
        self.text_bound = TextBound.of(self.tokenizer, self.model.max_model_len)
        if self.loras is None:
            self.loras = LoRARegistry(self.model.name)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def template_limits(self, truncating: bool = False) -> TemplateLimits:
        """What a chat render may cost: its output no longer than the context can hold (unless the prompt is to be
        truncated to its end: then the render may be as long as a request body)."""
        if truncating or self.text_bound.max_chars is None:
            return TemplateLimits(max_chars=max(self.limits.max_request_body_bytes, self.text_bound.max_chars or 0))
        return TemplateLimits(max_chars=self.text_bound.max_chars)

    async def in_tokenizer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, functools.partial(fn, *args))

    async def in_template_thread(self, limits: TemplateLimits, fn, *args, request_template: bool = False,
                                 raw_request: Request | None = None):
        """``fn(*args)``, which renders a chat template, in a thread of its own within ``limits``; a render that
        outlives its deadline is a 400 (its thread, left behind, stops at its next check). ``request_template``: the
        template came with the request. With ``raw_request``, the render stops when its client goes away
        (``ClientDisconnected``)."""
        runner = self._request_templates if request_template else self._templates
        try:
            if raw_request is None:
                return await runner.run(limits, fn, *args)
            return await run_until_disconnected(raw_request, runner.run(limits, fn, *args))
        except TemplateTimeout as exc:
            raise bad_request(f"the chat template could not render these messages within its bounds: {exc}",
                              param="messages", code="chat_template_limit") from None

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """Whether logprob entries name their tokens ``token_id:N``: the request's own field when it has one,
        else ``--return-tokens-as-token-ids`` (as vLLM decides it)."""
        return self.return_tokens_as_token_ids if requested is None else requested

    def check_model(self, model: str | None, pooling: bool = False) -> LoRARequest | None:
        """What a request's ``model`` names: None for the served model (or no name), else the LoRA adapter of
        that name. An unknown name is a 404; an adapter on a pooling route (``pooling``) a 400, as adapters serve
        generation only."""
        if model is None or model == self.model.name:
            return None
        adapter = self.loras.get(model)
        if adapter is None:
            served = repr(self.model.name)
            names = [repr(a.lora_name) for a in self.loras]
            if names:
                served += f" and the LoRA adapter{'s' if len(names) > 1 else ''} " + ", ".join(names[:8])
                served += f" (and {len(names) - 8} more)" if len(names) > 8 else ""
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                           INVALID_REQUEST, param="model", code="model_not_found")
        if pooling:
            raise bad_request(f"{model!r} is a LoRA adapter, and adapters serve generation only (completions, chat, "
                              f"responses, messages); name the model {self.model.name!r} here", param="model")
        return adapter

    def start_generation(self, prefix: str, prompts: list[TokenizedPrompt], params: SamplingParams,
                         mm_inputs: list[list] | None = None, *, model: str | None) -> Generation:
        """Admit a request: every prompt is checked before anything reaches the engine, so a bad
        prompt (or a full queue) answers a plain error instead of a half-started stream. ``mm_inputs``: per
        prompt, its images (``engine.loading.multimodal.ImageInput``s). ``model``: the request's, which sets the
        LoRA adapter it runs under (checked here, the one place every request passes, so that no route can leave
        it out)."""
        params.lora_request = self.check_model(model, pooling=params.pooling is not None)
        if params.stop and self.tokenizer is None:
            raise bad_request("stop strings need a tokenizer, and this model has none", param="stop")
        self.limits.check(len(prompts), params)
        check_params_for_engine(params, self.model.vocab_size)
        check_logprob_entries([len(p.token_ids) for p in prompts], params, self.model.info,
                              self.limits.max_logprob_entries)
        for i, prompt in enumerate(prompts):
            self.model.info.check_request(prompt.token_ids, params, mm_inputs[i] if mm_inputs else None)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        stream = self.engine.generate(request_id, [p.token_ids for p in prompts], params, mm_inputs=mm_inputs)
        name = self.model.name if params.lora_request is None else params.lora_request.lora_name
        return Generation(request_id, prompts, params, stream, name)


def check_params_for_engine(params: SamplingParams, vocab_size: int) -> None:
    """What the request's parameters carry to the engine beyond its prompts, checked as vLLM checks it: stop strings
    that are text (no lone surrogates), stop token ids in the vocabulary."""
    for stop in params.stop:
        check_unicode(stop, "stop")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token_id(s) {bad[:8]} in stop_token_ids contain out-of-vocab token ids. Vocabulary size: "
                          f"{vocab_size}", param="stop_token_ids")


def check_logprob_entries(prompt_lens: list[int], params: SamplingParams, info: ModelInfo,
                          max_entries: int | None) -> None:
    """Refuse a request whose logprobs could not be answered in a bounded response (``max_entries``,
    --max-logprob-entries; None: no bound): whole-vocabulary logprobs at every prompt token of a long prompt would
    take gigabytes to build."""
    def per_position(asked: int | None, named: list[int] | None = None) -> int:
        if named:
            return len(named) + 1
        return 0 if asked is None else 1 + (info.vocab_size if asked == -1 else asked)

    prompt_each = per_position(params.prompt_logprobs)
    sample_each = per_position(params.logprobs, params.logprob_token_ids)
    if max_entries is None or (not prompt_each and not sample_each):
        return
    prompt_entries = sum((n - 1) * prompt_each for n in prompt_lens) * params.n
    sample_entries = sum(params.max_tokens or max(info.max_model_len - n, 0) for n in prompt_lens) * sample_each
    total = prompt_entries + sample_entries * params.n
    if total > max_entries:
        param = "prompt_logprobs" if prompt_entries > max_entries else "logprobs"
        raise bad_request(f"this request could return {total:,} logprob entries ({prompt_entries:,} for prompt tokens,"
                          f" {total - prompt_entries:,} for generated ones); a response carries at most "
                          f"{max_entries:,} (--max-logprob-entries): ask for fewer logprobs per token, fewer tokens "
                          "(max_tokens) or a shorter prompt", param=param)


@dataclass
class ChoiceResult:
    """A whole choice, for non-streamed responses."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop_token_ids entry that ended it
    prompt_logprobs: list[Logprobs] | None = None  # prompt positions 1.., when asked for


async def collect(generation: Generation) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(generation.num_choices)]
    async with aclosing(generation.updates()) as updates:
        async for batch in updates:
            for delta in batch:
                result = results[delta.index]
                result.text += delta.text
                result.token_ids += delta.token_ids
                result.logprobs += delta.logprobs
                if delta.prompt_logprobs is not None:
                    result.prompt_logprobs = delta.prompt_logprobs
                result.finish_reason = delta.finish_reason
                result.stop_reason = delta.stop_reason
    return results


def usage_info(usage: Usage, prompt_tokens_details: bool = False) -> UsageInfo:
    """OpenAI's usage; ``prompt_tokens_details`` (the prefix-cache hits) only when the server runs with
    ``--enable-prompt-tokens-details``, as vLLM reports it."""
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens) if prompt_tokens_details
        else None,
    )


def request_metrics(ctx: ServingContext, generation: Generation) -> PerRequestMetrics | None:
    """vLLM's per-request timings (``--enable-per-request-metrics``), for a request of one choice only; None
    otherwise (several choices' timings would not be one stream's)."""
    timings = generation.stream.state.timings() if ctx.per_request_metrics else None
    if timings is None:
        return None

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000.0

    return PerRequestMetrics(time_to_first_token_ms=ms(timings.time_to_first_token_s),
                             generation_time_ms=ms(timings.generation_s), queue_time_ms=ms(timings.queue_s),
                             mean_itl_ms=ms(timings.mean_inter_token_s), tokens_per_second=timings.tokens_per_second)


def clamp_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def prompt_logprobs_view(tokenizer, entries: list[Logprobs] | None, as_id: bool) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token its own entry and the
    top-N, keyed by token id."""
    if entries is None:
        return None
    out: PromptLogprobs = [None]
    for entry in entries:
        ranked = {tid: PromptLogprob(logprob=clamp_logprob(lp), rank=rank, decoded_token=token_text(tokenizer, tid, as_id))
                  for rank, (tid, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1)}
        if entry.token_id not in ranked:
            ranked = {entry.token_id: PromptLogprob(logprob=clamp_logprob(entry.logprob), rank=entry.rank,
                                                    decoded_token=token_text(tokenizer, entry.token_id, as_id)),
                      **ranked}
        out.append({str(tid): value for tid, value in ranked.items()})
    return out


async def respond(
    raw_request: Request,
    stream: bool,
    chunks: Callable[[], AsyncIterator[BaseModel]],
    response: Callable[[], Awaitable[BaseModel]],
    headers: dict[str, str] | None = None,
) -> Response:
    """Stream the chunks as SSE, or build the whole response unless the client leaves first."""
    if stream:
        return SSEResponse(sse_stream(chunks()), headers=headers)
    try:
        body = await run_until_disconnected(raw_request, response())
    except ClientDisconnected:
        return client_closed_response()
    return Response(content=body.model_dump_json(), media_type="application/json", headers=headers)


def load_report(raw_request: Request) -> dict[str, str]:
    """The ORCA load report a load balancer asks for with ``endpoint-load-metrics-format: text|json``
    (as vLLM answers it): the engine's KV cache use and queue, in an ``endpoint-load-metrics`` header."""
    fmt = raw_request.headers.get("endpoint-load-metrics-format")
    if fmt is None:
        return {}
    stats = raw_request.app.state.ctx.engine.stats()
    metrics = {"kv_cache_usage_perc": round(stats.kv.usage, 6), "num_requests_waiting": stats.num_waiting,
               "num_requests_running": stats.num_running}
    if fmt.lower() == "text":
        return {"endpoint-load-metrics": "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in metrics.items())}
    if fmt.lower() == "json":
        return {"endpoint-load-metrics": "JSON " + json.dumps({"named_metrics": metrics})}
    raise bad_request(f"endpoint-load-metrics-format must be 'text' or 'json', not {fmt!r}",
                      param="endpoint-load-metrics-format")


async def sse_stream(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """``data: {chunk}`` events, then ``data: [DONE]``. An error mid-stream becomes an error event."""
    async for event in events_then_error(chunks, sse_event, lambda error: sse_event(error.to_dict())):
        yield event
    yield DONE
