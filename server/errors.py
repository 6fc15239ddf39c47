"""Every error leaves the server in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, or on the
Anthropic Messages routes in Anthropic's: ``{"type": "error", "error": {"type", "message"}}``.

Handlers raise ``APIError`` (or let an engine exception through); the handlers installed
here turn each into a JSON response with the right status. FastAPI's 422 for a body that
does not validate becomes a 400, and anything unexpected still answers in the same shape.
The shape is the route's (its ``error_style``, server/routing.py), whatever raised the error:
the API key check, the body limit, validation or the handler.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import RequestError
from engine.frontend.async_engine import EngineDeadError, EngineOverloadedError
from engine.sampling_params import SamplingParamsError

logger = logging.getLogger("minivllm.server")

# OpenAI's two types: every 4xx is an invalid request, every 5xx a server error.
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# Anthropic's types by status; another 4xx is an invalid request, another 5xx an api_error.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
                         529: "overloaded_error"}
ANTHROPIC = "anthropic"  # a route's error_style: errors in Anthropic's shape


class APIError(Exception):
    """An error with an HTTP status, answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_anthropic_dict(self) -> dict:
        default = "invalid_request_error" if self.status_code < 500 else "api_error"
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(self.status_code, default),
                                           "message": self.message}}

    def to_response(self, style: str | None = None) -> JSONResponse:
        """The error as a response: in Anthropic's shape for ``style`` ANTHROPIC, else in OpenAI's."""
        headers = dict(self.headers or {})
        if self.status_code == 401:
            headers["WWW-Authenticate"] = "Bearer"
        body = self.to_anthropic_dict() if style == ANTHROPIC else self.to_dict()
        return JSONResponse(body, status_code=self.status_code, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def as_api_error(exc: BaseException) -> APIError:
    """Map any exception to the error the client sees; unknown ones become a 500 (a bug)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), INVALID_REQUEST, exc.param, exc.code)
    if isinstance(exc, SamplingParamsError):
        return APIError(400, str(exc), INVALID_REQUEST, exc.param)
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), SERVER_ERROR, code="engine_overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), SERVER_ERROR, code="engine_unavailable")
    return APIError(500, f"internal server error: {exc!r}", SERVER_ERROR)


def _validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's first complaint, phrased for a client: which field, and what is wrong with it."""
    errors = exc.errors()
    if not errors:
        return bad_request("the request body is invalid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    if first.get("type") == "model_attributes_type" and tuple(first.get("loc", ())) == ("body",):
        return bad_request("the request body must be a JSON object (sent with Content-Type: application/json)")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members show up in the location ("prompt", "str"); keep the field path only.
    loc = [part for part in loc if not _is_type_name(part)]
    param = ".".join(loc) or None
    # Pydantic's name for the failure goes with its words ("greater_than_equal"), as vLLM's clients read it.
    message = f"{first.get('msg', 'invalid value')} [{first.get('type', 'invalid')}]"
    if param is None:
        return bad_request(f"the request body is invalid: {message}")
    return bad_request(f"{param}: {message}", param=param)


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict[", "function-", "union["))


def error_style(request: Request) -> str | None:
    """The shape errors take on the route that took the request (None: OpenAI's, also where no route did)."""
    return getattr(request.scope.get("route"), "error_style", None)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return as_api_error(exc).to_response(error_style(request))


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _validation_error(exc).to_response(error_style(request))


async def _http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    style = error_style(request)
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
        return APIError(404, message, INVALID_REQUEST, code="not_found").to_response(style)
    if exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        return APIError(405, message, INVALID_REQUEST, code="method_not_allowed",
                        headers=exc.headers).to_response(style)
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    error_type = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
    return APIError(exc.status_code, message, error_type).to_response(style)


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return as_api_error(exc).to_response(error_style(request))


def install_error_handlers(app: FastAPI) -> None:
    for exc_class in (APIError, RequestError, SamplingParamsError, EngineOverloadedError, EngineDeadError):
        app.add_exception_handler(exc_class, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
