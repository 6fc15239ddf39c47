"""OpenAI's Responses API on the chat path: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

    ResponsesRequest ── check_served, the previous response's items (ResponseStore)
        ── to_chat_request (server/responses_chat.py) ── start_chat (server/chat.py) ── ChatView
        ResponseView.response() ── one response object: reasoning, message and function_call items, usage
        ResponseView.events()   ── the Responses API's events (server/response_view.py)

The chat path does everything else as it does for /v1/chat/completions: validation and limits, the chat
template, images, tool calls (forced ones constrained by a grammar), structured outputs, the reasoning parser,
the engine and its metrics. A response is stored (unless ``store`` is false) once it has finished, in memory
and bounded (server/response_store.py); ``previous_response_id`` continues from it: its input items and
its output items come before the new input (its instructions do not carry over, as OpenAI's do not).
"""

from __future__ import annotations

from contextlib import aclosing

from fastapi import FastAPI, Request, Response

from server.chat import start_chat
from server.errors import INVALID_REQUEST, APIError
from server.openapi import error_responses
from server.protocol.responses import (
    STREAM_EVENTS,
    DeletedResponse,
    FunctionCallItem,
    InputText,
    MessageItem,
    OutputFunctionCall,
    OutputMessage,
    ResponseObject,
    ResponsesRequest,
)
from server.response_store import ResponseStore
from server.response_view import ResponseView, responses_sse
from server.responses_chat import check_served, input_items, responses_locations, to_chat_request
from server.serving import ServingContext, load_report
from server.streaming import ClientDisconnected, SSEResponse, client_closed_response, run_until_disconnected

_SSE = {"schema": {
    "type": "object", "required": ["event", "data"], "description": "One server-sent event of the Responses API.",
    "properties": {"event": {"type": "string", "enum": list(STREAM_EVENTS)},
                   "data": {"type": "string", "description": "The event as JSON: its `type` (the event's name) and "
                            "`sequence_number`; response.created, response.in_progress, response.completed and "
                            "response.incomplete carry a ResponseObject; an `error` event if the stream fails."}}}}
CREATE_RESPONSES = {
    200: {"model": ResponseObject, "description": "The response, whole or (`\"stream\": true`) as server-sent "
          "events.", "content": {"text/event-stream": _SSE}},
    **error_responses(400, 401, 404, 408, 413, 503)}


def add_responses_routes(app: FastAPI, ctx: ServingContext, store: ResponseStore | None = None) -> None:
    """The three routes, protected as the app's other OpenAI routes; ``store`` keeps the responses."""
    store = store if store is not None else ResponseStore()

    @app.post("/v1/responses", response_model=None, responses=CREATE_RESPONSES)
    async def create(body: ResponsesRequest, raw_request: Request) -> Response:
        """A model response, whole or streamed; stored unless ``store`` is false."""
        return await create_response(body, raw_request, ctx, store)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=error_responses(401, 404))
    async def retrieve(response_id: str) -> Response:
        """A stored response."""
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return Response(content=entry.response, media_type="application/json")

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=error_responses(401, 404))
    async def delete(response_id: str) -> DeletedResponse:
        """Forget a stored response."""
        if not store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return DeletedResponse(id=response_id)


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response has the id {response_id!r} (it was never stored, was deleted, or has "
                         "expired)", INVALID_REQUEST, param=param, code="not_found")


async def create_response(body: ResponsesRequest, raw_request: Request, ctx: ServingContext,
                          store: ResponseStore) -> Response:
    ctx.check_model(body.model)
    check_served(body, ctx.model.reasoning_parser)
    headers = load_report(raw_request)
    earlier: list = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        earlier = previous.items + previous.output
    translation = to_chat_request(body, earlier, bool(body.stream))
    try:
        chat = await start_chat(translation.body, raw_request, ctx, id_prefix="resp")
    except ClientDisconnected:
        return client_closed_response()
    except APIError as exc:
        raise responses_locations(exc, translation.origins) from None
    view = ResponseView(ctx, body, chat)
    items = earlier + input_items(body)
    if body.stream:
        return SSEResponse(responses_sse(_stored_events(view, store, items)), headers=headers)
    try:
        response = await run_until_disconnected(raw_request, view.response())
    except ClientDisconnected:
        return client_closed_response()
    content = response.model_dump_json()
    _store(store, body, response, content, items)
    return Response(content=content, media_type="application/json", headers=headers)


async def _stored_events(view: ResponseView, store: ResponseStore, items: list):
    """The view's events; the response is stored once the last has been sent (not when the client left)."""
    async with aclosing(view.events()) as events:  # a client that leaves aborts the generation at once
        async for event in events:
            yield event
    _store(store, view.request, view.final, view.final.model_dump_json(), items)


def _store(store: ResponseStore, body: ResponsesRequest, response: ResponseObject, content: str, items: list) -> None:
    if body.store is False:
        return
    own = sum(len(item.model_dump_json()) for item in input_items(body))
    store.put(response.id, content, items, _as_input(response.output), len(content) + own)


def _as_input(output: list) -> list:
    """A response's output items as the input items a follow-up would send back (reasoning is left out)."""
    items = []
    for item in output:
        if isinstance(item, OutputMessage):
            items.append(MessageItem(type="message", role="assistant", content=[
                InputText(type="output_text", text=part.text) for part in item.content]))
        elif isinstance(item, OutputFunctionCall):
            items.append(FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name,
                                          arguments=item.arguments))
    return items
