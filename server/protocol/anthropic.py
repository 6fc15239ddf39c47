"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): the request, its content blocks,
tools and thinking, and the answer, its stream's events and its errors.

As the OpenAI models, nothing is silently ignored: a field or block type this server does not serve is a 400
that names it (server tools, ``container``, ``mcp_servers``, documents and the rest). ``cache_control``
markers are accepted wherever Anthropic takes them: the prefix cache keeps every prompt's full KV blocks
anyway, so a marker asks for nothing the server does not already do. ``metadata.user_id`` labels a request
only (as OpenAI's ``user``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from server.protocol.common import RequestModel

# Anthropic's request fields that this server does not serve, and why: a request that sends one is told so.
UNSUPPORTED_FIELDS = {
    "container": "code execution containers are not available here",
    "mcp_servers": "this server connects to no MCP servers",
    "context_management": "context editing is not available here",
    "output_config": "output formats are not available here; force a tool with tool_choice for JSON",
    "output_format": "output formats are not available here; force a tool with tool_choice for JSON",
    "service_tier": "this server has one service tier",
    "inference_geo": "this server has one region",
    "speed": "this server has one speed",
    "diagnostics": "prompt-cache diagnostics are not available here",
}


class CacheControl(RequestModel):
    """A prompt-caching breakpoint: accepted, and kept as every prefix is (the prefix cache needs no marker)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockParam(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[list[dict], Field(max_length=0)] | None = None  # the server makes none: only none back


class Base64ImageSource(RequestModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLImageSource(RequestModel):
    type: Literal["url"]
    url: str  # http(s)://, fetched as the chat route fetches image URLs (--allowed-media-domains)


class ImageBlockParam(RequestModel):
    type: Literal["image"]
    source: Annotated[Union[Base64ImageSource, URLImageSource], Field(discriminator="type")]
    cache_control: CacheControl | None = None


class ToolUseBlockParam(RequestModel):
    """An assistant turn's tool call, sent back."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockParam(RequestModel):
    """A user turn's answer to a tool call: text (a string or text blocks); ``is_error`` marks a failed call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlockParam(RequestModel):
    """An assistant turn's thinking, sent back: accepted and left out of the prompt, as Anthropic leaves past
    turns' thinking out of the context (chat templates drop past reasoning too)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


ContentBlockParam = Annotated[Union[TextBlockParam, ImageBlockParam, ToolUseBlockParam, ToolResultBlockParam,
                                    ThinkingBlockParam], Field(discriminator="type")]


def _content_kind(value: Any) -> str:
    return "list[ContentBlockParam]" if isinstance(value, list) else "str"


# A string or a list of blocks, told apart by the value's own type (as the chat route's content), so that a bad
# block is answered by what is wrong with it.
MessageContent = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[ContentBlockParam],
                                                                        Tag("list[ContentBlockParam]")]],
                           Discriminator(_content_kind)]


class MessageParam(RequestModel):
    role: Literal["user", "assistant", "system"]
    content: MessageContent


class ToolDefinition(RequestModel):
    """A client tool: its name, what it does, and the JSON schema of its input. Anthropic's server tools (web
    search, code execution, bash, the text editor, ...) carry a ``type`` of their own and are refused by it."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # constrain the calls to the schema (as the chat route's strict tools)
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ValueError(f"server tools (type {kind!r}) are not available here: give client tools (name, "
                             "description, input_schema) and run them yourself")
        return data


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


class ThinkingEnabled(RequestModel):
    """Thinking with a budget; ``budget_tokens`` below ``max_tokens``, as Anthropic asks. The budget is not a
    bound of its own: the thinking ends when the model ends it, within max_tokens."""

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1, le=2**31 - 1)
    display: Literal["summarized"] | None = None  # the thinking is returned whole ("omitted" is not served)


class ThinkingAdaptive(RequestModel):
    type: Literal["adaptive"]
    display: Literal["summarized"] | None = None


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled], Field(discriminator="type")]


class Metadata(RequestModel):
    user_id: str | None = None  # labels the request; not used


class CountTokensRequest(RequestModel):
    """What makes a prompt: ``/v1/messages/count_tokens`` counts it, ``/v1/messages`` answers it."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in UNSUPPORTED_FIELDS.items():
                if name in data:
                    raise ValueError(f"{name} is not supported by this server: {why}")
        return data


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    metadata: Metadata | None = None
    stream: bool | None = False


# ------------------------------------------------------------------------------ the answer


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    """The model's thinking, split off by the server's reasoning parser; the signature is empty (this server
    signs nothing, and takes thinking blocks back whatever their signature)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ThinkingBlock], Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(BaseModel):
    input_tokens: int  # the whole prompt (cached prefix blocks included): what count_tokens counts
    output_tokens: int


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, overloaded_error, api_error, ...
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


STREAM_EVENTS = ("message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop", "error")
