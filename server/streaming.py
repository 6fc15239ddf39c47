"""How results travel back: server-sent events, and noticing a client that went away.

A streamed response is cancelled by Starlette when the client disconnects; ``SSEResponse``
also closes its body iterator explicitly, so the generation behind it is torn down (and
its engine requests aborted) right away, not when the garbage collector gets to it.
A non-streamed request runs in a task raced against the client's disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from server.errors import APIError, as_api_error

T = TypeVar("T")
logger = logging.getLogger("minivllm.server")

DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody receives it


def sse_event(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else _json(payload)
    return f"data: {body}\n\n"


def _json(payload: dict) -> str:
    return json.dumps(payload, separators=(",", ":"))


def named_event(event: dict) -> str:
    """``event: <type>`` and ``data: <json>``: the events of Anthropic's Messages API and OpenAI's Responses API."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def events_then_error(items: AsyncIterator[T], encode: Callable[[T], str],
                            encode_error: Callable[[APIError], str]) -> AsyncIterator[str]:
    """Each item as an event; a failure once the stream has begun (its status line is sent) becomes one error event
    in the API's shape (``encode_error``), which ends it. A failure of the server itself (a 5xx other than 503) is
    logged with its traceback."""
    try:
        async with aclosing(items):
            async for item in items:
                yield encode(item)
    except Exception as exc:  # noqa: BLE001 - the status line is sent already; tell the client in-band
        error = as_api_error(exc)
        if error.status_code >= 500 and error.status_code != 503:
            logger.exception("error while streaming")
        yield encode_error(error)


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (that aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (uvicorn blocks until then).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def client_closed_response() -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
