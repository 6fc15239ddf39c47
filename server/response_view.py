"""One chat generation as a Responses API response object, or as its stream of events.

    output items, in the order the model wrote them:
        reasoning      the thinking the reasoning parser split off (one reasoning_text part)
        message        the answer's text (one output_text part)
        function_call  each tool call (call_id is the chat path's call id)

    stream: response.created, response.in_progress; per item output_item.added, then
        message        content_part.added, output_text.delta..., output_text.done, content_part.done
        reasoning      content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
        function_call  function_call_arguments.delta..., function_call_arguments.done
    and output_item.done; then response.completed (response.incomplete when max_output_tokens cut it).

Every event has ``type`` and ``sequence_number`` (from 0). A failure once the stream has begun is an
``error`` event, and ends it. A response cut by max_output_tokens has status "incomplete" and
``incomplete_details.reason`` "max_output_tokens"; its last item is "incomplete" too.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from server.chat import ChatView
from server.errors import SERVER_ERROR, APIError
from server.protocol.responses import (
    FunctionTool,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from server.serving import ServingContext
from server.streaming import events_then_error, named_event
from server.tokenization import encode


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseView:
    """The response to ``request``, answered by ``chat``."""

    def __init__(self, ctx: ServingContext, request: ResponsesRequest, chat: ChatView):
        self.ctx = ctx
        self.request = request
        self.chat = chat
        self.id = "resp_" + chat.id.partition("-")[2]
        self.created_at = int(time.time())

    def skeleton(self, output: list, status: str, usage: ResponseUsage | None = None) -> ResponseObject:
        """The response object: the request's settings echoed, with ``output``, ``status`` and ``usage``."""
        request = self.request
        text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text is not None and \
            request.text.format is not None else {"format": {"type": "text"}}
        effort = request.reasoning.effort if request.reasoning is not None else None
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        model = request.model or self.ctx.model.name  # a LoRA adapter's name when the request named one
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=model, output=output,
            incomplete_details=incomplete, usage=usage, instructions=request.instructions,
            tools=[tool for tool in request.tools or [] if isinstance(tool, FunctionTool)],
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            parallel_tool_calls=request.parallel_tool_calls is not False, temperature=request.temperature,
            top_p=request.top_p, max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, text=text,
            reasoning={"effort": effort, "summary": None}, metadata=request.metadata or {},
            store=request.store is not False, user=request.user)

    async def usage(self, reasoning: str) -> ResponseUsage:
        usage = self.chat.generation.usage()
        num_reasoning = len(await self.ctx.in_tokenizer_thread(encode, self.ctx.tokenizer, reasoning, False)) \
            if reasoning else 0
        return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                             total_tokens=usage.prompt_tokens + usage.completion_tokens,
                             input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
                             output_tokens_details=OutputTokensDetails(reasoning_tokens=min(
                                 num_reasoning, usage.completion_tokens)))

    async def response(self) -> ResponseObject:
        chat_response = await self.chat.response()
        choice = chat_response.choices[0]
        status = _status(choice.finish_reason)
        output: list = []
        if choice.message.reasoning:
            output.append(OutputReasoning(id=new_id("rs"), content=[ReasoningText(text=choice.message.reasoning)]))
        if choice.message.content:
            output.append(OutputMessage(id=new_id("msg"), content=[OutputText(text=choice.message.content)]))
        output += [OutputFunctionCall(id=new_id("fc"), call_id=call.id, name=call.function.name,
                                      arguments=call.function.arguments) for call in choice.message.tool_calls]
        if status == "incomplete" and output:
            output[-1].status = "incomplete"
        return self.skeleton(output, status, await self.usage(choice.message.reasoning or ""))

    async def events(self) -> AsyncIterator[dict]:
        """The stream's events, as dicts without their sequence numbers; the last one's ``response`` is the
        whole response (``self.final`` holds it as a ResponseObject)."""
        snapshot = self.skeleton([], "in_progress").model_dump()
        yield {"type": "response.created", "response": snapshot}
        yield {"type": "response.in_progress", "response": snapshot}
        items = _Items()
        finish = None
        async with aclosing(self.chat.chunks()) as chunks:
            async for chunk in chunks:
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.reasoning:
                        for event in items.text("reasoning", delta.reasoning):
                            yield event
                    if delta.content:
                        for event in items.text("message", delta.content):
                            yield event
                    for call in delta.tool_calls or []:
                        for event in items.call(call):
                            yield event
                    if choice.finish_reason is not None:
                        finish = choice.finish_reason
        status = _status(finish)
        for event in items.close("incomplete" if status == "incomplete" else "completed"):
            yield event
        self.final = self.skeleton(items.done, status, await self.usage(items.reasoning))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield {"type": kind, "response": self.final.model_dump()}


class _Items:
    """The stream's output items: one open at a time, numbered from 0 as they start."""

    def __init__(self):
        self.done: list = []  # finished items, as the final response lists them
        self.open_item: dict | None = None
        self.reasoning = ""  # all the thinking, for the usage's reasoning tokens
        self._calls: dict[int, int] = {}  # the chat path's call index -> its output index

    @property
    def index(self) -> int:
        return len(self.done)

    def _open(self, item: dict) -> list[dict]:
        events = self.close("completed")
        self.open_item = item
        added = {key: value for key, value in item.items() if key != "text"}  # the text is the stream's
        events.append({"type": "response.output_item.added", "output_index": self.index, "item": added})
        if item["type"] in ("message", "reasoning"):
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": self.index, "content_index": 0, "part": _part(item["type"], "")})
        return events

    def text(self, kind: str, delta: str) -> list[dict]:
        events = []
        if self.open_item is None or self.open_item["type"] != kind:
            prefix = "msg" if kind == "message" else "rs"
            events += self._open({"type": kind, "id": new_id(prefix), "status": "in_progress", "content": [],
                                  **({"role": "assistant"} if kind == "message" else {"summary": []}),
                                  "text": ""})
        self.open_item["text"] += delta
        if kind == "reasoning":
            self.reasoning += delta
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        event = {"type": name, "item_id": self.open_item["id"], "output_index": self.index, "content_index": 0,
                 "delta": delta}
        if kind == "message":
            event["logprobs"] = []
        return events + [event]

    def call(self, call) -> list[dict]:
        events = []
        if call.id is not None:
            events += self._open({"type": "function_call", "id": new_id("fc"), "call_id": call.id,
                                  "name": call.function.name, "arguments": "", "status": "in_progress"})
            self._calls[call.index] = self.index
        arguments = call.function.arguments if call.function is not None else None
        if arguments and self._calls.get(call.index) == self.index and self.open_item is not None:
            self.open_item["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": self.open_item["id"],
                           "output_index": self.index, "delta": arguments})
        return events

    def close(self, status: str) -> list[dict]:
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        common = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **common, "name": item["name"],
                       "arguments": item["arguments"]}]
            finished = OutputFunctionCall(id=item["id"], call_id=item["call_id"], name=item["name"],
                                          arguments=item["arguments"], status=status)
        else:
            text, kind = item["text"], item["type"]
            done = {"type": f"response.{'output' if kind == 'message' else 'reasoning'}_text.done", **common,
                    "content_index": 0, "text": text}
            if kind == "message":
                done["logprobs"] = []
            events = [done, {"type": "response.content_part.done", **common, "content_index": 0,
                             "part": _part(kind, text)}]
            finished = OutputMessage(id=item["id"], content=[OutputText(text=text)], status=status) \
                if kind == "message" else OutputReasoning(id=item["id"], content=[ReasoningText(text=text)],
                                                          status=status)
        events.append({"type": "response.output_item.done", "output_index": self.index, "item": finished.model_dump()})
        self.done.append(finished)
        return events


def _part(kind: str, text: str) -> dict:
    if kind == "message":
        return OutputText(text=text).model_dump()
    return ReasoningText(text=text).model_dump()


def _status(finish_reason: str | None) -> str:
    if finish_reason == "abort":
        raise APIError(503, "the request ended before it finished (the server is shutting down, or its tool "
                            "grammar could not be built in time)", SERVER_ERROR)
    return "incomplete" if finish_reason == "length" else "completed"


def responses_sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """``event: <type>`` and ``data: <json>`` per event, numbered by ``sequence_number``; a failure once the
    stream has begun is an ``error`` event, and ends it."""
    numbers = itertools.count()
    return events_then_error(
        events, lambda event: named_event({**event, "sequence_number": next(numbers)}),
        lambda error: named_event({"type": "error", "code": error.code, "message": error.message,
                                   "param": error.param, "sequence_number": next(numbers)}))
