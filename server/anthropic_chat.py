"""An Anthropic Messages request as the chat request it amounts to, so the chat machinery serves it.

    system (string or text blocks)      -> a system message first
    user: text, image blocks            -> a user message of text and image_url parts (data: URL for base64)
    user: tool_result blocks            -> one tool message each (tool_call_id, its text; "Error: " first
                                           when is_error), in their place among the user's parts
    assistant: text, tool_use blocks    -> an assistant message with content and tool_calls
    assistant: thinking blocks          -> left out (past turns' thinking is not part of the prompt)
    an assistant message last           -> continued (continue_final_message): Anthropic's prefill
    tools, tool_choice auto/any/tool/none -> function tools, "auto"/"required"/the named function/"none"
    thinking enabled/adaptive/disabled  -> chat_template_kwargs enable_thinking true/true/false (false when
                                           left out, as Anthropic thinks only when asked)

Errors the chat path raises name its messages (``messages.3.content.1``); ``anthropic_locations`` says
them as the Anthropic request has them.
"""

from __future__ import annotations

import json
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
    NamedFunction,
    NamedToolChoice,
    ToolCallParam,
    ToolParam,
)
from server.protocol.anthropic import (
    CountTokensRequest,
    ImageBlockParam,
    MessageParam,
    MessagesRequest,
    TextBlockParam,
    ThinkingBlockParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)

ERROR_PREFIX = "Error: "  # a tool result with is_error: its text as the model reads it


@dataclass
class ChatTranslation:
    """The chat request, where each of its messages came from, and whether at most one tool call is wanted."""

    body: ChatCompletionRequest
    # Per chat message: the Anthropic location it came from ("system" or "messages.i") and, per content part,
    # the index of its block there.
    origins: list[tuple[str, list[int]]] = field(default_factory=list)
    single_tool_use: bool = False


def to_chat_request(request: CountTokensRequest, reasoning_parser: str | None) -> ChatTranslation:
    """The chat request for ``request`` (a MessagesRequest, or a CountTokensRequest that only makes a prompt);
    ``reasoning_parser``: the server's, without which thinking cannot be asked for."""
    messages, origins = [], []
    if request.system:
        messages.append(ChatMessageParam(role="system", content=_text(request.system, "system")))
        origins.append(("system", []))
    for i, message in enumerate(request.messages):
        for chat_message, blocks in _chat_messages(i, message):
            messages.append(chat_message)
            origins.append((f"messages.{i}", blocks))
    fields: dict = {"messages": messages,
                    "chat_template_kwargs": {"enable_thinking": _thinking(request, reasoning_parser)}}
    if request.messages and request.messages[-1].role == "assistant":
        fields.update(add_generation_prompt=False, continue_final_message=True)
    tool_fields, single_tool_use = _tool_fields(request)
    fields.update(tool_fields)
    if isinstance(request, MessagesRequest):
        fields.update(model=request.model, max_tokens=request.max_tokens, stop=request.stop_sequences,
                      temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                      stream=bool(request.stream))
    return ChatTranslation(ChatCompletionRequest(**fields), origins, single_tool_use)


def _thinking(request: CountTokensRequest, reasoning_parser: str | None) -> bool:
    thinking = request.thinking
    if thinking is None or thinking.type == "disabled":
        return False
    if reasoning_parser is None:
        raise bad_request("thinking: this server splits no thinking off the answer (it was started without "
                          "--reasoning-parser), so it cannot answer thinking blocks; leave thinking out or disable it",
                          param="thinking")
    if thinking.type == "enabled" and isinstance(request, MessagesRequest) and \
            thinking.budget_tokens >= request.max_tokens:
        raise bad_request(f"thinking.budget_tokens ({thinking.budget_tokens}) must be less than max_tokens "
                          f"({request.max_tokens})", param="thinking.budget_tokens")
    return True


def _tool_fields(request: CountTokensRequest) -> tuple[dict, bool]:
    """The chat request's tool fields, and whether only the first call is wanted (disable_parallel_tool_use)."""
    tools = [ToolParam(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.input_schema, strict=tool.strict))
        for tool in request.tools or []]
    choice = request.tool_choice
    fields: dict = {"tools": tools or None}
    if choice is None:
        return fields, False
    if choice.type in ("any", "tool") and not tools:
        raise bad_request(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "none" or (choice.type == "auto" and tools):
        fields["tool_choice"] = choice.type
    elif choice.type == "any":
        fields["tool_choice"] = "required"
    elif choice.type == "tool":
        fields["tool_choice"] = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    single = bool(getattr(choice, "disable_parallel_tool_use", None)) and bool(tools)
    if single:
        fields["parallel_tool_calls"] = False
    return fields, single


def _chat_messages(i: int, message: MessageParam) -> list[tuple[ChatMessageParam, list[int]]]:
    """One Anthropic message as chat messages, each with the indices of the blocks its parts came from."""
    if isinstance(message.content, str):
        return [(ChatMessageParam(role=message.role, content=message.content), [])]
    if message.role == "system":
        return [(ChatMessageParam(role="system", content=_text(message.content, f"messages.{i}.content")), [])]
    if message.role == "assistant":
        return [_assistant_message(i, message)]
    out, parts, origin = [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlockParam):
            if parts:
                out.append((ChatMessageParam(role="user", content=parts), origin))
                parts, origin = [], []
            out.append((ChatMessageParam(role="tool", content=_tool_result(block, f"messages.{i}.content.{j}"),
                                         tool_call_id=block.tool_use_id), [j]))
        elif isinstance(block, (TextBlockParam, ImageBlockParam)):
            parts.append(_part(block, f"messages.{i}.content.{j}"))
            origin.append(j)
        else:
            raise bad_request(f"messages.{i}.content.{j}: {block.type} blocks belong to assistant turns",
                              param=f"messages.{i}.content.{j}")
    if parts or not out:
        out.append((ChatMessageParam(role="user", content=parts), origin))
    return out


def _assistant_message(i: int, message: MessageParam) -> tuple[ChatMessageParam, list[int]]:
    parts, origin, calls = [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            parts.append(ContentPart(type="text", text=block.text))
            origin.append(j)
        elif isinstance(block, ToolUseBlockParam):
            calls.append(ToolCallParam(id=block.id, function=FunctionCallParam(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
        elif not isinstance(block, ThinkingBlockParam):
            raise bad_request(f"messages.{i}.content.{j}: {block.type} blocks belong to user turns",
                              param=f"messages.{i}.content.{j}")
    content = parts[0].text if len(parts) == 1 else parts or None
    return ChatMessageParam(role="assistant", content=content, tool_calls=calls or None), origin


def _part(block: TextBlockParam | ImageBlockParam, where: str) -> ContentPart:
    if isinstance(block, TextBlockParam):
        return ContentPart(type="text", text=block.text)
    source = block.source
    if source.type == "base64":
        return ContentPart(type="image_url", image_url=ImageURL(url=f"data:{source.media_type};base64,{source.data}"))
    if not source.url.startswith(("http://", "https://")):
        raise bad_request(f"{where}.source.url: an image URL is http:// or https://; send other images as base64 "
                          "sources", param=f"{where}.source.url")
    return ContentPart(type="image_url", image_url=ImageURL(url=source.url))


def _tool_result(block: ToolResultBlockParam, where: str) -> str:
    text = _text(block.content, f"{where}.content") if block.content is not None else ""
    return ERROR_PREFIX + text if block.is_error else text


def _text(content: str | list, where: str) -> str:
    """A string, or text blocks joined by newlines (as the chat route joins text parts); other blocks are a 400."""
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        if not isinstance(block, TextBlockParam):
            raise bad_request(f"{where}.{j}: only text blocks go here, not {block.type}", param=f"{where}.{j}")
    return "\n".join(block.text for block in content)


_CHAT_LOCATION = re.compile(r"messages\.(\d+)(?:\.content\.(\d+)(\.image_url)?)?")


def anthropic_locations(error: APIError, origins: list[tuple[str, list[int]]]) -> APIError:
    """``error`` with the chat messages (and parts) it names said as the Anthropic request's locations (an
    ``image_url`` part's URL is an image block's ``source``)."""
    def located(match: re.Match) -> str:
        index = int(match.group(1))
        if index >= len(origins):
            return match.group(0)
        where, blocks = origins[index]
        part = match.group(2)
        if part is None or where == "system":
            return where
        if int(part) >= len(blocks):
            return f"{where}.content"
        return f"{where}.content.{blocks[int(part)]}" + (".source" if match.group(3) else "")

    error.message = _CHAT_LOCATION.sub(located, error.message)
    if error.param is not None:
        error.param = _CHAT_LOCATION.sub(located, error.param)
    return error
