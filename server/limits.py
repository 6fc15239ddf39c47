"""What one client may ask of the server, and how long a connection may take to ask it.

    connection ── headers within header_timeout_s ──> (else 408, closed)     GuardedHttpProtocol
               ── a known route; its body within body_timeout_s, at most max_request_body_bytes
                                                                 ──> (else 404/405, 408 / 413)   BodyLimit
               ── request checked: prompts x n, stop strings, max_tokens ──> (else 400)
                                                                             ServerLimits.check_*

Every refusal is in OpenAI's error shape, including uvicorn's own answer to a request it
cannot parse. The defaults are generous for real clients and bound what a hostile one costs.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine.sampling_params import SamplingParams
from server.errors import INVALID_REQUEST, APIError, bad_request


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 32 * 2**20
    max_choices_per_request: int = 256  # prompts x n: each choice is one engine request
    max_stop_strings: int = 64
    max_stop_chars: int = 16384  # all stop strings of a request together
    max_tokens_limit: int | None = None  # a ceiling on max_tokens, and its default; None: the context
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    # Logprob entries one response may carry (a whole-vocabulary position is vocab_size + 1 of them): some 70 MB of
    # JSON and ~1 GB to build at 2**20. None: no bound (vLLM has none).
    max_logprob_entries: int | None = 2**20

    def check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_choices_per_request:
            raise bad_request(f"this request asks for {num_prompts} prompts x n={n} = {num_prompts * n} choices; "
                              f"the server allows at most {self.max_choices_per_request} per request", param="n")

    def check_stop(self, stop: list[str]) -> None:
        if len(stop) > self.max_stop_strings:
            raise bad_request(f"{len(stop)} stop strings; the server allows at most {self.max_stop_strings}",
                              param="stop")
        total = sum(len(s) for s in stop)
        if total > self.max_stop_chars:
            raise bad_request(f"the stop strings have {total} characters together; the server allows at most "
                              f"{self.max_stop_chars}", param="stop")

    def apply_max_tokens(self, max_tokens: int | None, param: str, default: int | None = None) -> int | None:
        """The request's max_tokens under the server's ceiling (a 400 beyond it); for a request that gave none,
        ``default`` (the model's generation config, or the endpoint's own) within the ceiling, or the ceiling."""
        limit = self.max_tokens_limit
        if max_tokens is None:
            if limit is None or default is None:
                return default if limit is None else limit
            return min(default, limit)
        if limit is not None and max_tokens > limit:
            raise bad_request(f"{param}={max_tokens} is more than this server allows ({limit}, --max-tokens-limit)",
                              param=param)
        return max_tokens

    def check(self, num_prompts: int, params: SamplingParams) -> None:
        self.check_choices(num_prompts, params.n)
        self.check_stop(params.stop)


# ------------------------------------------------------------------- request bodies


class BodyLimit:
    """Read a request's whole body before its handler sees it: at most ``max_bytes`` (413 beyond), and
    within ``timeout_s`` (408 when a client sends it too slowly). The handler then reads it from memory.

    Routes apply it (server/routing.py) once a request has matched one with an allowed method: a
    request for an unknown route or method is answered without its body ever being read."""

    def __init__(self, max_bytes: int, timeout_s: float):
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def read(self, scope, receive):
        """A ``receive`` that replays the whole body, or None when the client left while sending it.
        Raises APIError (413, 408) when the body is too large or too slow."""
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            raise _too_large(declared, self.max_bytes)
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except _BodyTooLarge as exc:
            raise _too_large(exc.size, self.max_bytes) from None
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.timeout_s:g} s", INVALID_REQUEST,
                           code="request_timeout") from None
        except _Disconnected:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # from here on, only the disconnect

        return replay

    async def _read(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _BodyTooLarge(Exception):
    def __init__(self, size: int):
        self.size = size


class _Disconnected(Exception):
    pass


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has at least {size} bytes; the server accepts at most {limit} "
                         f"(--max-request-body-mb)", INVALID_REQUEST, code="request_too_large")


# ----------------------------------------------------------------------- connections


def guarded_http_protocol(header_timeout_s: float) -> type:
    """uvicorn's httptools protocol, closing connections that do not send a request's headers within
    ``header_timeout_s`` (idle new connections and slow-header clients alike), and answering the
    requests it cannot parse in OpenAI's error shape."""

    class GuardedHttpProtocol(HttpToolsProtocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(APIError(400, f"the request could not be parsed: {msg}", INVALID_REQUEST,
                                       code="bad_http_request").to_dict()).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                 + body)
            self.transport.close()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._on_header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return  # a request is being answered: its body has its own timeout
            self.transport.close()

    return GuardedHttpProtocol
