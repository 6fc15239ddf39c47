"""Anthropic's Messages API on the chat path: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

    MessagesRequest ── to_chat_request (server/anthropic_chat.py) ── start_chat (server/chat.py) ── ChatView
        ChatView.response() ── one Message: thinking, text and tool_use blocks, stop_reason, usage
        ChatView.chunks()   ── Anthropic's events: message_start, ping, per block content_block_start,
                               content_block_delta (thinking_delta, text_delta, input_json_delta),
                               content_block_stop; message_delta (stop_reason, usage), message_stop

The chat path does everything else as it does for /v1/chat/completions: validation and limits, the chat
template, images, tool calls (forced ones constrained by a grammar), the reasoning parser, the engine and
its metrics. A failure after the stream has begun is an ``error`` event. Errors on these routes are in
Anthropic's shape, and the API key may come as ``x-api-key`` (server/routing.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated

from fastapi import FastAPI, Header, Request, Response

from server.anthropic_chat import anthropic_locations, to_chat_request
from server.chat import ChatView, chat_prompt, start_chat
from server.errors import ANTHROPIC, SERVER_ERROR, APIError
from server.limits import BodyLimit
from server.openapi import COUNT_TOKENS_RESPONSES, MESSAGES_RESPONSES
from server.protocol.anthropic import (
    AnthropicMessage,
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessageUsage,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from server.routing import guarded_route_class
from server.serving import ServingContext, load_report
from server.streaming import (
    ClientDisconnected,
    SSEResponse,
    client_closed_response,
    events_then_error,
    named_event,
    run_until_disconnected,
)
from server.tool_parsers import get_parser, loads_partial, new_call_id
from server.tools import ToolPlan

VersionHeader = Annotated[str | None, Header(alias="anthropic-version", description=(
    "Anthropic's API version; accepted whatever it says (this server speaks 2023-06-01)."))]
BetaHeader = Annotated[str | None, Header(alias="anthropic-beta", description=(
    "Anthropic's beta features; accepted, and a beta's request fields are still refused by name (a 400)."))]


def add_anthropic_routes(app: FastAPI, ctx: ServingContext, body_limit: BodyLimit) -> None:
    """The two routes, on the app itself (its routes are what the OpenAPI document marks as protected), protected
    by the server's API key (``x-api-key`` or a bearer token) and answering errors in Anthropic's shape."""
    route_class = guarded_route_class(ctx.api_key or None, body_limit, ANTHROPIC, accepts_x_api_key=True)

    async def messages(body: MessagesRequest, raw_request: Request, anthropic_version: VersionHeader = None,
                       anthropic_beta: BetaHeader = None) -> Response:
        """A message from the model, whole or streamed (Anthropic's server-sent events)."""
        return await create_message(body, raw_request, ctx)

    async def count_tokens(body: CountTokensRequest, raw_request: Request, anthropic_version: VersionHeader = None,
                           anthropic_beta: BetaHeader = None) -> CountTokensResponse | Response:
        """The prompt's tokens as the chat template renders them (images included): ``usage.input_tokens``
        of a message for the same request."""
        ctx.check_model(body.model)
        translation = to_chat_request(body, ctx.model.reasoning_parser)
        tools = ToolPlan.of(translation.body, get_parser(ctx.model.tool_parser))
        try:
            prompt_ids, _ = await chat_prompt(ctx, translation.body, tools, raw_request)
        except ClientDisconnected:
            return client_closed_response()
        except APIError as exc:
            raise anthropic_locations(exc, translation.origins) from None
        return CountTokensResponse(input_tokens=len(prompt_ids))

    app.router.add_api_route("/v1/messages", messages, methods=["POST"], response_model=None,
                             responses=MESSAGES_RESPONSES, route_class_override=route_class)
    app.router.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"],
                             response_model=CountTokensResponse, responses=COUNT_TOKENS_RESPONSES,
                             route_class_override=route_class)


async def create_message(body: MessagesRequest, raw_request: Request, ctx: ServingContext) -> Response:
    ctx.check_model(body.model)
    headers = load_report(raw_request)
    translation = to_chat_request(body, ctx.model.reasoning_parser)
    try:
        chat = await start_chat(translation.body, raw_request, ctx, id_prefix="msg")
    except ClientDisconnected:
        return client_closed_response()
    except APIError as exc:
        raise anthropic_locations(exc, translation.origins) from None
    view = MessageView(ctx, chat, translation.single_tool_use)
    if body.stream:
        return SSEResponse(anthropic_sse(view.events()), headers=headers)
    try:
        message = await run_until_disconnected(raw_request, view.message())
    except ClientDisconnected:
        return client_closed_response()
    return Response(content=message.model_dump_json(), media_type="application/json", headers=headers)


class MessageView:
    """One chat generation as Anthropic's Message, or as its stream of events."""

    def __init__(self, ctx: ServingContext, chat: ChatView, single_tool_use: bool):
        self.ctx = ctx
        self.chat = chat
        self.single_tool_use = single_tool_use  # tool_choice's disable_parallel_tool_use: the first call only
        self.id = "msg_" + chat.id.partition("-")[2]

    def _message(self, content: list[ContentBlock], stop_reason=None, stop_sequence=None) -> AnthropicMessage:
        usage = self.chat.generation.usage()
        return AnthropicMessage(id=self.id, model=self.chat.generation.model, content=content, stop_reason=stop_reason,
                                stop_sequence=stop_sequence, usage=MessageUsage(
                                    input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens))

    async def message(self) -> AnthropicMessage:
        response = await self.chat.response()
        choice = response.choices[0]
        content: list[ContentBlock] = []
        if choice.message.reasoning:
            content.append(ThinkingBlock(thinking=choice.message.reasoning))
        if choice.message.content:
            content.append(TextBlock(text=choice.message.content))
        calls = choice.message.tool_calls[:1] if self.single_tool_use else choice.message.tool_calls
        content += [ToolUseBlock(id=tool_use_id(call.id), name=call.function.name,
                                 input=_tool_input(call.function.arguments)) for call in calls]
        return self._message(content, *stop_reason(choice.finish_reason, choice.stop_reason, bool(calls)))

    async def events(self) -> AsyncIterator[dict]:
        """Anthropic's events, as dicts (``type`` names each)."""
        start = self._message([]).model_dump()
        start["usage"]["output_tokens"] = 0
        yield {"type": "message_start", "message": start}
        yield {"type": "ping"}
        blocks = _Blocks()
        finish = stop = None
        async with aclosing(self.chat.chunks()) as chunks:
            async for chunk in chunks:
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.reasoning:
                        for event in blocks.delta("thinking", {"type": "thinking_delta", "thinking": delta.reasoning}):
                            yield event
                    if delta.content:
                        for event in blocks.delta("text", {"type": "text_delta", "text": delta.content}):
                            yield event
                    for call in delta.tool_calls or []:
                        for event in self._call_events(blocks, call):
                            yield event
                    if choice.finish_reason is not None:
                        finish, stop = choice.finish_reason, choice.stop_reason
        for event in blocks.close():
            yield event
        reason, sequence = stop_reason(finish, stop, blocks.num_calls > 0)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": {"output_tokens": self.chat.generation.usage().completion_tokens}}
        yield {"type": "message_stop"}

    def _call_events(self, blocks: _Blocks, call) -> list[dict]:
        if self.single_tool_use and call.index > 0:
            return []
        events = []
        if call.id is not None:
            events += blocks.open("tool_use", {"type": "tool_use", "id": tool_use_id(call.id),
                                               "name": call.function.name, "input": {}})
            blocks.num_calls += 1
        arguments = call.function.arguments if call.function is not None else None
        if arguments:
            events += blocks.delta("tool_use", {"type": "input_json_delta", "partial_json": arguments})
        return events


class _Blocks:
    """The stream's content blocks: one open at a time, numbered from 0 as they start."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None
        self.num_calls = 0

    def open(self, kind: str, block: dict) -> list[dict]:
        events = self.close()
        self.index += 1
        self.kind = kind
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def delta(self, kind: str, delta: dict) -> list[dict]:
        events = [] if self.kind == kind else self.open(kind, _EMPTY_BLOCKS[kind])
        return events + [{"type": "content_block_delta", "index": self.index, "delta": delta}]


_EMPTY_BLOCKS = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "",
                                                                      "signature": ""}}


def stop_reason(finish_reason: str | None, stop: int | str | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish reason and stop reason."""
    if finish_reason == "abort":
        raise APIError(503, "the request ended before it finished (the server is shutting down, or its tool "
                            "grammar could not be built in time)", SERVER_ERROR)
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` id for a chat tool call's ``call_`` one."""
    return "toolu_" + (call_id.removeprefix("call_") or new_call_id().removeprefix("call_"))


def _tool_input(arguments: str) -> dict:
    """A call's input: its arguments, or as much of them as was written (a call cut off by max_tokens)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        try:
            value = loads_partial(arguments)
        except Exception:  # noqa: BLE001 - not even the start of a JSON value
            value = None
    return value if isinstance(value, dict) else {}


def anthropic_sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """``event: <type>`` and ``data: <json>`` per event; a failure once the stream has begun is an ``error``
    event in Anthropic's shape, and ends it."""
    return events_then_error(events, named_event, lambda error: named_event(error.to_anthropic_dict()))
