"""OpenAI's Responses API (``/v1/responses``): the request, its input items and tools, and the response object.

As the other request models, nothing is silently ignored: a field this server does not serve is a 400 that
names it (``UNSUPPORTED_FIELDS`` says why), and so is an unknown one. Input items may carry back what the
server answered before (an item's ``id`` and ``status``, an output text's ``annotations``): those are accepted
and play no part in the prompt.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from server.protocol.common import RequestModel

# The Responses API's request fields that this server does not serve, and why: a request that sends one is told so.
UNSUPPORTED_FIELDS = {
    "background": "background responses are not available here; send the request and wait for its answer, or stream "
                  "it",
    "conversation": "conversations are not available here; chain responses with previous_response_id",
    "prompt": "stored prompt templates are not available here; send the input itself",
    "max_tool_calls": "built-in tools are not available here, so there is no tool-call budget to set",
    "top_logprobs": "logprobs are not available on this route; use /v1/chat/completions",
    "context_management": "context compaction is not available here",
}


class InputText(RequestModel):
    """A text part of a message: ``input_text`` (the user's, system's or developer's) or ``output_text`` (the
    assistant's, sent back; its annotations and logprobs are accepted and not used)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(RequestModel):
    """An image part: an ``http(s)://`` or ``data:`` URL, fetched as the chat route fetches image URLs."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


InputContentPart = Annotated[Union[InputText, InputImage], Field(discriminator="type")]


def _by_value(value: Any) -> str:
    return "list[]" if isinstance(value, list) else "dict[]" if isinstance(value, dict) else "str"


# Unions told apart by the value's own type or by an item's ``type``, so that a bad value is answered by what is
# wrong with it ("input.0.content.1.type: ...") rather than by another member's complaint. The tags are written as
# type names (``list[...]``, ``dict[...]``), which error locations leave out (server/errors.py).
MessageContent = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[InputContentPart], Tag("list[]")]],
                           Discriminator(_by_value)]


class MessageItem(RequestModel):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: MessageContent
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(RequestModel):
    """A call the model made, sent back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(RequestModel):
    """The answer to a call: text, or text parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningItem(RequestModel):
    """A reasoning item sent back: accepted and left out of the prompt (past turns' thinking is not part of it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class UnservedItem(BaseModel):
    """An item of another type (item_reference, file_search_call, web_search_call, ...): a 400 that names it."""

    model_config = ConfigDict(extra="allow")
    type: Any

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        raise ValueError(f"{value!r} items are not available here (message, function_call, function_call_output "
                         "and reasoning items are)")


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(value: Any) -> str:
    """The item's type (none: a message)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None) or "message"
    return f"dict[{kind}]" if kind in _ITEM_TYPES else "dict[]"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("dict[message]")],
                            Annotated[FunctionCallItem, Tag("dict[function_call]")],
                            Annotated[FunctionCallOutputItem, Tag("dict[function_call_output]")],
                            Annotated[ReasoningItem, Tag("dict[reasoning]")],
                            Annotated[UnservedItem, Tag("dict[]")]], Discriminator(_item_kind)]


Input = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[InputItem], Tag("list[]")]],
                  Discriminator(_by_value)]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class BuiltinTool(BaseModel):
    """Any other tool type (web_search, file_search, code_interpreter, computer_use, mcp, ...): a 400 names it."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "dict[function]" if kind == "function" else "dict[builtin]"


Tool = Annotated[Union[Annotated[FunctionTool, Tag("dict[function]")], Annotated[BuiltinTool, Tag("dict[builtin]")]],
                 Discriminator(_tool_kind)]


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("str")],
                             Annotated[FunctionToolChoice, Tag("dict[]")]], Discriminator(_by_value)]


class JSONSchemaTextFormat(RequestModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class PlainTextFormat(RequestModel):
    type: Literal["text", "json_object"]


def _format_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "dict[json_schema]" if kind == "json_schema" else "dict[]"


class TextConfig(RequestModel):
    format: Annotated[Union[Annotated[PlainTextFormat, Tag("dict[]")],
                            Annotated[JSONSchemaTextFormat, Tag("dict[json_schema]")]],
                      Discriminator(_format_kind)] | None = None


class ReasoningConfig(RequestModel):
    """How much to think: "none" turns a reasoning model's thinking off, any other effort on (with a reasoning
    parser only; the length of the thinking is the model's own, whatever effort is named)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: None = None  # summaries are not written: the reasoning item carries the thinking itself
    generate_summary: None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: Input = Field(default_factory=list)
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # a 400 unless empty (no obfuscation is written)
    store: bool | None = None  # default true: kept for previous_response_id and GET (server/response_store.py)
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping earlier items) is not available
    include: Annotated[list[str], Field(max_length=0)] | None = None  # nothing extra to include
    # Labels only: they change nothing the answer carries but themselves.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # every prompt's full KV blocks are kept anyway (the prefix cache)
    service_tier: Literal["auto", "default"] | None = None
    # Refused by name (UNSUPPORTED_FIELDS).
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: list[Any] | None = None


# ----------------------------------------------------------------------------- the response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Annotated[Union[OutputMessage, OutputFunctionCall, OutputReasoning], Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response, as OpenAI's SDK parses it (``output_text`` joins its messages' text)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | None = None
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
    background: bool = False
    service_tier: Literal["default"] = "default"


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


STREAM_EVENTS = ("response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                 "response.content_part.done", "response.reasoning_text.delta", "response.reasoning_text.done",
                 "response.function_call_arguments.delta", "response.function_call_arguments.done",
                 "response.output_item.done", "response.completed", "response.incomplete", "error")
