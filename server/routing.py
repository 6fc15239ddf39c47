"""How a request reaches its route: the prefix it may carry, and what a route checks before its body is read.

    request ── RootPath: /prefix/v1/... and /v1/... both route to /v1/...
            ── the router picks a route (404, 405 or a redirect: answered, the body never read)
            ── GuardedRoute: the API key (a protected route), then BodyLimit ──> the handler

The API key belongs to the route, not to a path prefix: whatever prefix, proxy or socket a
request came through, a protected route's handler runs only after the key was checked, and
the key is checked before the body is read, so a client without it learns and costs nothing.
Routes take it as ``Authorization: Bearer <key>``; the Anthropic Messages routes also as
``x-api-key: <key>`` (Anthropic's header), and answer their errors in Anthropic's shape.
"""

from __future__ import annotations

import secrets

from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError
from server.limits import BodyLimit

_BODYLESS_METHODS = ("GET", "HEAD", "OPTIONS")


class RootPath:
    """Serve the app under ``root_path`` whether the proxy in front strips the prefix or not.

    uvicorn's own ``--root-path`` prefixes every path with it, so a request that still carries
    the prefix (no proxy, or one that forwards it) would route to ``/prefix/prefix/...``. Here
    the prefix only goes into the scope's ``root_path``: Starlette routes on the path with the
    prefix taken off when it has one, and URLs (``/openapi.json``'s servers) name the prefix.
    """

    def __init__(self, app: ASGIApp, root_path: str):
        self.app = app
        self.root_path = normalize_root_path(root_path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.root_path and scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


def normalize_root_path(root_path: str) -> str:
    """'/llm' for 'llm', '/llm/' or '/llm'; '' for no prefix."""
    stripped = root_path.strip("/")
    return f"/{stripped}" if stripped else ""


def guarded_route_class(api_key: str | None, body_limit: BodyLimit, error_style: str | None = None,
                        accepts_x_api_key: bool = False) -> type[APIRoute]:
    """An APIRoute class whose routes check ``api_key`` (when not None), then read their body within
    ``body_limit``, before FastAPI's handler runs. Give it to an APIRouter (``route_class``).
    ``error_style``: the shape of the routes' errors (server/errors.py); ``accepts_x_api_key``: the key may also
    come as ``x-api-key``."""
    key = api_key.encode() if api_key is not None else None

    class GuardedRoute(APIRoute):
        requires_api_key = key is not None

        async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
            # Called by the router once it chose this route, for an allowed method or not (405).
            if key is not None:
                error = api_key_error(scope, key, accepts_x_api_key)
                if error is not None:
                    raise error
            if scope["method"] in self.methods and scope["method"] not in _BODYLESS_METHODS:
                replay = await body_limit.read(scope, receive)
                if replay is None:
                    return  # the client left while sending the body: nobody to answer
                receive = replay
            await super().handle(scope, receive, send)

    GuardedRoute.error_style = error_style
    GuardedRoute.accepts_x_api_key = accepts_x_api_key
    return GuardedRoute


def api_key_error(scope: Scope, api_key: bytes, accepts_x_api_key: bool = False) -> APIError | None:
    """None when the request carries ``Authorization: Bearer <api_key>`` (compared in constant time), or with
    ``accepts_x_api_key`` ``x-api-key: <api_key>``: a request that sends both is let in when either is right."""
    if accepts_x_api_key:
        keys = [value for name, value in scope["headers"] if name == b"x-api-key"]
        if len(keys) > 1:
            return APIError(401, "send one x-api-key header, not several", code="invalid_api_key")
        if keys:
            if secrets.compare_digest(keys[0].strip(), api_key) or _bearer_error(scope, api_key, "") is None:
                return None
            return APIError(401, "invalid API key", code="invalid_api_key")
        return _bearer_error(scope, api_key, "'x-api-key: <key>' or 'Authorization: Bearer <key>'")
    return _bearer_error(scope, api_key, "'Authorization: Bearer <key>'")


def _bearer_error(scope: Scope, api_key: bytes, how: str) -> APIError | None:
    values = [value for name, value in scope["headers"] if name == b"authorization"]
    if len(values) > 1:
        return APIError(401, "send one Authorization header, not several", code="invalid_api_key")
    scheme, _, token = (values[0] if values else b"").partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return APIError(401, f"missing API key: send it as {how}", code="invalid_api_key")
    if not secrets.compare_digest(token.strip(), api_key):
        return APIError(401, "invalid API key", code="invalid_api_key")
    return None
