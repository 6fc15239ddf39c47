"""The OpenAI wire format: pydantic models for every request and response body.

Nothing a request carries is silently ignored: a field is implemented, or a 400 names it
(unknown fields too, as OpenAI does), except OpenAI's metadata-only fields in
``METADATA_FIELDS``, accepted and not used. Types are strict: ``"n": "2"`` is a 400, not a
silent 2. Value ranges are checked once, by ``SamplingParams``; the bounds here only keep
numbers inside what the engine's arrays hold.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_serializer

from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

MAX_N = 128  # parallel samples per prompt
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# OpenAI request fields that only label a request for the caller's own bookkeeping: accepted, not used.
METADATA_FIELDS = ("user", "metadata", "store", "service_tier")


# ---------------------------------------------------------------------------- requests


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage so far on every chunk


class _OmitNone(BaseModel):
    """A stream chunk whose vLLM extras (``omitted_when_none``) are left out of its JSON when not set, as vLLM
    leaves them out of its chunks (a whole response carries them as null)."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unset_extras(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None or k not in self.omitted_when_none}


class JSONSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None  # an xgrammar structural tag


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat; ``None`` means "the default"."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=_INT32_MAX)
    min_p: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(None, le=MAX_N)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None  # vLLM: the prompt's and each choice's token ids in the response
    allowed_token_ids: list[int] | None = None  # vLLM: sample only among these
    # vLLM: keep only the prompt's last N tokens (-1: as many as the context holds with max_tokens)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM: which end truncate_prompt_tokens cuts: "left" (the default) keeps the last N, "right" the first N
    truncation_side: Literal["left", "right"] | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprob entries name tokens as "token_id:N"
    # vLLM: the top-N logprobs of every prompt token (scoring), -1 for the whole vocabulary
    prompt_logprobs: int | None = None
    # vLLM: the logprobs of these token ids at each generated position, in place of the top-N (with logprobs)
    logprob_token_ids: list[int] | None = None
    # vLLM: beam search of width n (the n best beams are the choices), scored with length_penalty
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names for structured_outputs.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Metadata only (METADATA_FIELDS).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far on every chunk (vLLM's ``continuous_usage_stats``). As in vLLM it takes effect with
        ``include_usage`` only: without it no chunk carries usage."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None,
                           tool_grammar: StructuredOutputsParams | None = None,
                           skip_special_tokens: bool | None = None, reasoning: str | None = None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """Validated engine parameters: the request's values, else ``defaults`` (the model's generation
        config), else the engine's. ``max_tokens=None`` lets the engine fill the context.

        ``tool_grammar``: the constraint the tools put on the output; ``reasoning``: where the output's
        thinking block is (StructuredOutputsParams.reasoning), so that constraints start after it;
        ``prompt_logprobs``: when the request's own field is unset (completions' ``echo`` with ``logprobs``)."""
        if self.prompt_logprobs is not None:
            # vLLM's rules: a stream has nowhere to put them (0 asks only for the prompt tokens' own).
            if self.stream and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
                raise SamplingParamsError("`prompt_logprobs` are not available when `stream=True`", "prompt_logprobs")
            if self.prompt_logprobs < -1:
                raise SamplingParamsError("`prompt_logprobs` must be a positive value or -1", "prompt_logprobs")
            prompt_logprobs = self.prompt_logprobs
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options is only allowed when stream is true", "stream_options")
        named = self.logprob_token_ids or None  # vLLM's: an empty list names none
        if named is not None:
            if self.use_beam_search:
                raise SamplingParamsError("`logprob_token_ids` is not supported with beam search.",
                                          "logprob_token_ids")
            if logprobs is None:
                raise SamplingParamsError(f"when using `logprob_token_ids`, `logprobs` must be "
                                          f"{'set to true' if isinstance(self.logprobs, bool) else 'set'}.",
                                          "logprob_token_ids")
            logprobs = 0  # the named tokens take the top-N's place: only the sampled token's own is computed
        fields = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        given = {name: value for name, value in fields.items() if value is not None}
        sampling = {name: value for name, value in (defaults or {}).items() if name != "max_tokens"}
        if self.use_beam_search:
            # Beams are ranked by the model's own logprobs: the generation config's sampling knobs do not apply,
            # and a temperature asked for could not be honoured.
            if self.temperature not in (None, 0):
                raise SamplingParamsError("temperature cannot be combined with use_beam_search (beams are ranked "
                                          "by the model's logprobs)", "temperature")
            sampling = {}
            given.update(use_beam_search=True, length_penalty=1.0 if self.length_penalty is None
                         else self.length_penalty)
        elif self.length_penalty is not None:
            raise SamplingParamsError("length_penalty applies to beam search: set use_beam_search", "length_penalty")
        if skip_special_tokens is not None and self.skip_special_tokens is None:
            given["skip_special_tokens"] = skip_special_tokens  # the tool-call parser needs its markers
        structured = self.structured_outputs_params()
        if tool_grammar is not None:
            if structured is not None:
                raise SamplingParamsError("the tools constrain the output already (tool_choice 'required', a named "
                                          "function or strict tools): leave out response_format and structured "
                                          "outputs", "tool_choice")
            structured = tool_grammar
        if structured is not None and reasoning is not None and structured.structural_tag is None:
            structured = dataclasses.replace(structured, reasoning=reasoning)
        return SamplingParams(**{**sampling, **given}, max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, logit_bias=self._logit_bias(), structured_outputs=structured,
                              allowed_token_ids=self.allowed_token_ids, logprob_token_ids=named)

    def _logit_bias(self) -> dict[int, float] | None:
        """Token id keys (ASCII digits: ``"²"`` is no id) to biases; every key that is not one is named."""
        if not self.logit_bias:
            return None
        bias, bad = {}, []
        for key, value in self.logit_bias.items():
            # ASCII digits only: str.isdigit() also takes "²" and "١٢", which are no token ids.
            token_id = _ascii_int(key)
            if token_id is None:
                bad.append(key)
            else:
                bias[token_id] = value
        if bad:
            raise SamplingParamsError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: "
                                      f"{[k[:32] for k in bad[:8]]!r}", "logit_bias")
        return bias

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one grammar the request asks for, by whichever name it used (``param`` names it: the handler
        checks it once, off the event loop, with ``check_structured_outputs``). Every JSON schema is
        compiled strictly, as vLLM does whatever ``strict`` says: no properties beyond those it lists."""
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", StructuredOutputsParams(json_object=True, param="response_format")))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise SamplingParamsError("response_format: json_schema needs a schema", "response_format")
            asked.append(("response_format", _vllm_spec(fmt.json_schema.schema_, None, None, None, None,
                                                        "response_format")))
        so = self.structured_outputs
        if so is not None:
            asked.append(("structured_outputs", _vllm_spec(so.json_, so.regex, so.choice, so.grammar,
                                                           so.json_object, "structured_outputs",
                                                           structural_tag=so.structural_tag)))
        legacy = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}
        for name, value in legacy.items():
            if value is not None:
                asked.append((name, _vllm_spec(*(value if k == name else None for k in legacy), None, name)))
        if not asked:
            return None
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise SamplingParamsError(f"ask for one structured output, not several ({names})", asked[1][0])
        return asked[0][1]



def _ascii_int(text: str) -> int | None:
    if not (text.isascii() and text.isdigit()):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts
        return None


def _vllm_spec(json_schema, regex, choice, grammar, json_object, param: str,
               structural_tag=None) -> StructuredOutputsParams:
    try:
        if isinstance(json_schema, dict):
            json_schema = json.dumps(json_schema)
        if isinstance(structural_tag, dict):
            structural_tag = json.dumps(structural_tag)
    except RecursionError:
        raise SamplingParamsError(f"{param}: the JSON is nested too deeply", param) from None
    try:
        return StructuredOutputsParams(json=json_schema, regex=regex, choice=choice, grammar=grammar,
                                       json_object=bool(json_object), structural_tag=structural_tag, param=param)
    except SamplingParamsError as exc:
        raise SamplingParamsError(str(exc).replace("structured outputs", param), param) from None


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


class ImageURL(RequestModel):
    """An ``image_url`` part's image: a ``data:`` URL or an ``http(s)://`` one (server/media.py)."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None  # None: "auto"; passed along to the engine


class ContentPart(RequestModel):
    """A part of a message's content: ``text``, or ``image_url`` (for a model that takes images). Other
    part types (audio, video, files) carry fields of their own; the type is what answers them (a 400)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


def _content_kind(value: Any) -> str:
    return "list[ContentPart]" if isinstance(value, list) else "str"


# A message's content: a string or a list of parts. Told apart by the value's own type, so a bad part is
# answered by what is wrong with it ("messages.0.content.1.image_url.detail: ...") rather than by the string
# branch's "Input should be a valid string"; the tags are type names, which error locations leave out.
MessageContent = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[ContentPart], Tag("list[ContentPart]")]],
                           Discriminator(_content_kind)]


class MessageModel(BaseModel):
    """A part of a chat message: fields it does not know are ignored, as OpenAI and vLLM ignore them (clients
    send back what they received, ``refusal`` or ``annotations`` included); the request's own fields stay strict."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class FunctionCallParam(MessageModel):
    name: str
    arguments: str  # JSON text


class ToolCallParam(MessageModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(MessageModel):
    role: str  # OpenAI's roles, or any other: the chat template gets it as given (as vLLM passes it)
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer: which call it answers


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class ToolParam(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # -1: the whole vocabulary (within --max-logprobs)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: continue the last (assistant) message instead of a new one
    echo: bool = False  # vLLM: the reply starts with the last message when it is the assistant's (continued)
    chat_template: str | None = None  # vLLM: a Jinja chat template for this request
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # extra variables for the chat template (e.g. enable_thinking)


class TokenizeRequest(RequestModel):
    """Either a ``prompt`` (text) or chat ``messages`` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    chat_template: str | None = None
    tools: list[ToolParam] | None = None  # with messages: rendered as a chat completion would render them
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(_OmitNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("prompt_tokens_details",)  # as vLLM: absent unless enabled
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry for one token of a prompt: its logprob, its rank (1: the likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token, None for the first: the token's own entry and the top-N, by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class PerRequestMetrics(_OmitNone):
    """vLLM's per-request timings (``--enable-per-request-metrics``), for a request of one choice; a timing
    that cannot be known (the mean inter-token latency of a single token) is left out."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ("time_to_first_token_ms", "generation_time_ms",
                                                    "queue_time_ms", "mean_itl_ms", "tokens_per_second")
    time_to_first_token_ms: float | None = None  # first scheduling to the first token
    generation_time_ms: float | None = None  # the first token to the last
    queue_time_ms: float | None = None  # arrival to first scheduling
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None  # generated tokens over first scheduling to the last token


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


class CompletionStreamChoice(_OmitNone):
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
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    metrics: PerRequestMetrics | None = None  # with --enable-per-request-metrics


class CompletionChunk(_OmitNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("metrics",)
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    metrics: PerRequestMetrics | None = None  # with --enable-per-request-metrics: on the usage chunk


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # A reasoning model's thinking (--reasoning-parser): vLLM's name, and the older reasoning_content (the same).
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # left out of the JSON when empty, as vLLM does

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler):
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop_token_ids entry that ended it
    token_ids: list[int] | None = None  # with return_token_ids, else null


class ChatCompletionResponse(BaseModel):
    """A whole chat completion: vLLM's extras are always there, null when not asked for."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs
    metrics: PerRequestMetrics | None = None  # with --enable-per-request-metrics


class DeltaMessage(BaseModel):
    """A chat stream's increment; fields left out are absent from the JSON (``{}`` at the end)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # the thinking, under both names (as ChatMessage)
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(_OmitNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("token_ids",)
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the chunk's tokens


class ChatCompletionChunk(_OmitNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "prompt_logprobs", "metrics")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in the first chunks
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs=0: with the first token
    metrics: PerRequestMetrics | None = None  # with --enable-per-request-metrics: on the usage chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "minivllm"
    root: str | None = None
    max_model_len: int | None = None
    # What prompts may carry: ["text"], or ["text", "image"] for a model that takes images.
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs (else null): each token as the vocabulary writes it


class DetokenizeResponse(BaseModel):
    prompt: str
