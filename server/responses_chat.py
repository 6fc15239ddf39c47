"""A Responses API request as the chat request it amounts to, so the chat machinery serves it.

    instructions                         -> a system message first
    input: a string                      -> one user message
    message items (user, system,         -> chat messages of that role ("developer" as "system"); input_text and
      developer, assistant)                 output_text parts as text, input_image parts as image_url parts
    function_call items                  -> the assistant message's tool_calls (one assistant message for a run
                                            of text and calls, as a chat conversation has them)
    function_call_output items           -> tool messages (tool_call_id, the output's text)
    reasoning items                      -> left out (past turns' thinking is not part of the prompt)
    tools (function), tool_choice        -> function tools, "auto"/"none"/"required"/the named function
    text.format json_schema/json_object  -> response_format (structured outputs)
    reasoning.effort                     -> chat_template_kwargs enable_thinking ("none": false, else true), with a
                                            reasoning parser only
    max_output_tokens, temperature, top_p -> max_completion_tokens, temperature, top_p

The items of a ``previous_response_id`` come first (server/response_store.py). Errors the chat path raises
name its messages (``messages.3.content.1``); ``responses_locations`` says them as ``input`` items.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from server.errors import APIError, bad_request
from server.protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    ContentPart,
    FunctionCallParam,
    FunctionDefinition,
    ImageURL,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallParam,
    ToolParam,
)
from server.protocol.responses import (
    UNSUPPORTED_FIELDS,
    BuiltinTool,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputText,
    JSONSchemaTextFormat,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)


@dataclass
class ChatTranslation:
    """The chat request, and per chat message the location of the item it came from (``input.3``)."""

    body: ChatCompletionRequest
    origins: list[str] = field(default_factory=list)


def check_served(request: ResponsesRequest, reasoning_parser: str | None) -> None:
    """A 400 for what this server does not serve: the fields it refuses, built-in tools, thinking without a
    reasoning parser."""
    for name, why in UNSUPPORTED_FIELDS.items():
        if getattr(request, name) not in (None, False):
            raise bad_request(f"{name}: {why}", param=name)
    if request.stream_options:
        raise bad_request("stream_options: no stream options are available here (the events carry no obfuscation)",
                          param="stream_options")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    for i, tool in enumerate(request.tools or []):
        if isinstance(tool, BuiltinTool):
            raise bad_request(f"tools.{i}: {tool.type!r} tools are not available here; only function tools are",
                              param=f"tools.{i}.type")
    if request.reasoning is not None and reasoning_parser is None:
        raise bad_request("reasoning: this server splits no reasoning off the answer (it was started without "
                          "--reasoning-parser), so it cannot honour a reasoning effort; leave reasoning out",
                          param="reasoning")


def input_items(request: ResponsesRequest) -> list:
    """The request's input as items (a string is one user message)."""
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]
    return list(request.input)


def to_chat_request(request: ResponsesRequest, earlier: list, stream: bool) -> ChatTranslation:
    """The chat request for ``request``, after the ``earlier`` items of its previous response (its input and
    output items, and theirs); an item's location is ``input.{i}`` (``previous_response_id`` for earlier ones)."""
    messages, origins = [], []
    if request.instructions:
        messages.append(ChatMessageParam(role="system", content=request.instructions))
        origins.append("instructions")
    items = earlier + input_items(request)
    for i, item in enumerate(items):
        where = f"input.{i - len(earlier)}" if i >= len(earlier) else "previous_response_id"
        message = _chat_message(item, where)
        if message is None:
            continue
        last = messages[-1] if messages else None
        if isinstance(item, FunctionCallItem) and last is not None and last.role == "assistant":
            last.tool_calls = (last.tool_calls or []) + message.tool_calls
            continue
        messages.append(message)
        origins.append(where)
    fields: dict = {"messages": messages, "model": request.model, "max_completion_tokens": request.max_output_tokens,
                    "temperature": request.temperature, "top_p": request.top_p, "stream": stream,
                    "parallel_tool_calls": request.parallel_tool_calls if request.tools else None}
    if request.reasoning is not None and request.reasoning.effort is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": request.reasoning.effort != "none"}
    fields.update(_tool_fields(request), response_format=_response_format(request))
    return ChatTranslation(ChatCompletionRequest(**fields), origins)


def _tool_fields(request: ResponsesRequest) -> dict:
    tools = [ToolParam(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict))
        for tool in request.tools or []]
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return {"tools": tools or None, "tool_choice": choice}


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if isinstance(fmt, JSONSchemaTextFormat):
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))
    return ResponseFormat(type="json_object")


def _chat_message(item, where: str) -> ChatMessageParam | None:
    if isinstance(item, ReasoningItem):
        return None
    if isinstance(item, FunctionCallItem):
        return ChatMessageParam(role="assistant", tool_calls=[ToolCallParam(
            id=item.call_id, function=FunctionCallParam(name=item.name, arguments=item.arguments))])
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else "\n".join(part.text for part in item.output)
        return ChatMessageParam(role="tool", content=output, tool_call_id=item.call_id)
    assert isinstance(item, MessageItem)
    role = "system" if item.role == "developer" else item.role
    if isinstance(item.content, str):
        return ChatMessageParam(role=role, content=item.content)
    if role in ("system", "assistant"):
        return ChatMessageParam(role=role, content=_text(item.content, f"{where}.content"))
    parts = [ContentPart(type="text", text=part.text) if isinstance(part, InputText) else
             ContentPart(type="image_url", image_url=ImageURL(url=part.image_url, detail=part.detail))
             for part in item.content]
    return ChatMessageParam(role=role, content=parts)


def _text(parts: list, where: str) -> str:
    """Text parts joined by newlines (as the chat route joins them); an image here is a 400."""
    for j, part in enumerate(parts):
        if not isinstance(part, InputText):
            raise bad_request(f"{where}.{j}: only text parts go here, not {part.type}", param=f"{where}.{j}")
    return "\n".join(part.text for part in parts)


_CHAT_LOCATION = re.compile(r"messages\.(\d+)")


def responses_locations(error: APIError, origins: list[str]) -> APIError:
    """``error`` with the chat messages it names said as the request's locations (``input.2``)."""
    def located(match: re.Match) -> str:
        index = int(match.group(1))
        return origins[index] if index < len(origins) else match.group(0)

    error.message = _CHAT_LOCATION.sub(located, error.message)
    if error.param is not None:
        error.param = _CHAT_LOCATION.sub(located, error.param)
    return error
