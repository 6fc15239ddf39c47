"""/v1/chat/completions: messages (text and image parts, tool calls), tools, the request, and the whole response
and stream chunks."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_serializer

from server.protocol.common import OmitNone, PerRequestMetrics, PromptLogprobs, RequestModel, UsageInfo, unix_now
from server.protocol.sampling import SamplingRequest


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
    created: int = Field(default_factory=unix_now)
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


class ChatStreamChoice(OmitNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("token_ids",)
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the chunk's tokens


class ChatCompletionChunk(OmitNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "prompt_logprobs", "metrics")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in the first chunks
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs=0: with the first token
    metrics: PerRequestMetrics | None = None  # with --enable-per-request-metrics: on the usage chunk
