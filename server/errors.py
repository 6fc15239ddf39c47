"""Every error leaves the server in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError`` (or let an engine exception through); the handlers installed
here turn each into a JSON response with the right status. FastAPI's 422 for a body that
does not validate becomes a 400, and anything unexpected still answers in the same shape.
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

    def to_response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.status_code == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers=headers or None)


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


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return as_api_error(exc).to_response()


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _validation_error(exc).to_response()


async def _http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
        return APIError(404, message, INVALID_REQUEST, code="not_found").to_response()
    if exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        return APIError(405, message, INVALID_REQUEST, code="method_not_allowed", headers=exc.headers).to_response()
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    error_type = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
    return APIError(exc.status_code, message, error_type).to_response()


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return as_api_error(exc).to_response()


def install_error_handlers(app: FastAPI) -> None:
    for exc_class in (APIError, RequestError, SamplingParamsError, EngineOverloadedError, EngineDeadError):
        app.add_exception_handler(exc_class, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
