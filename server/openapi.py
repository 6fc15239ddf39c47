"""``/openapi.json`` that tells the truth: what each route answers, errors included.

FastAPI documents a 422 for every body it validates; this server answers those with a 400
in OpenAI's error shape (Anthropic's on the Messages routes), so the 422s are replaced. Streamed
responses are server-sent events, described as ``text/event-stream`` beside the JSON body. With an
API key, the protected routes say they need a bearer token (or, on the Messages routes, ``x-api-key``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from server.protocol import ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse
from server.protocol.anthropic import STREAM_EVENTS, AnthropicErrorResponse, AnthropicMessage, CountTokensResponse


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_DESCRIPTIONS = {
    400: "The request is invalid: a field, its value, or what it asks of the model.",
    401: "A missing or wrong API key (only when the server has one).",
    404: "An unknown model or route.",
    408: "The request body did not arrive in time.",
    413: "The request body is too large.",
    503: "The engine is overloaded, shutting down, or has failed.",
}


def error_responses(*codes: int) -> dict[int, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]} for code in codes}


def _sse(chunk_names: str) -> dict[str, Any]:
    return {"schema": {"type": "object", "required": ["data"], "description": "One server-sent event.",
                       "properties": {"data": {"type": "string",
                                               "description": f"A {chunk_names} as JSON; an ErrorResponse as JSON if "
                                                              "the stream fails; `[DONE]` last."},
                                      "event": {"type": "string"}}}}


def generation_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict[int, dict[str, Any]]:
    """200 as one JSON body, or (``"stream": true``) as SSE events carrying ``chunk`` objects."""
    return {200: {"model": body, "description": "The generation, whole or streamed.",
                  "content": {"text/event-stream": _sse(chunk.__name__)}},
            **error_responses(400, 401, 404, 408, 413, 503)}


COMPLETION_RESPONSES = generation_responses(CompletionResponse, CompletionChunk)
CHAT_RESPONSES = generation_responses(ChatCompletionResponse, ChatCompletionChunk)


def _either(*models: type[BaseModel]) -> dict[str, Any]:
    return {"oneOf": [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]}


def anthropic_error_responses(*codes: int) -> dict[int, dict[str, Any]]:
    """The errors of the Anthropic Messages routes, in Anthropic's shape."""
    return {code: {"model": AnthropicErrorResponse, "description": _DESCRIPTIONS[code]} for code in codes}


_ANTHROPIC_SSE = {"schema": {
    "type": "object", "required": ["event", "data"], "description": "One server-sent event of Anthropic's stream.",
    "properties": {"event": {"type": "string", "enum": list(STREAM_EVENTS)},
                   "data": {"type": "string", "description": "The event as JSON, its `type` the event's name: "
                            "message_start (a Message without content), ping, content_block_start, "
                            "content_block_delta (text_delta, thinking_delta or input_json_delta), "
                            "content_block_stop, message_delta (stop_reason, stop_sequence, usage.output_tokens), "
                            "message_stop; an AnthropicErrorResponse if the stream fails."}}}}
MESSAGES_RESPONSES = {
    200: {"model": AnthropicMessage, "description": "The message, whole or (`\"stream\": true`) as Anthropic's "
          "server-sent events.", "content": {"text/event-stream": _ANTHROPIC_SSE}},
    **anthropic_error_responses(400, 401, 404, 408, 413, 503)}
COUNT_TOKENS_RESPONSES = {200: {"model": CountTokensResponse, "description": "The prompt's tokens."},
                          **anthropic_error_responses(400, 401, 404, 408, 413)}


# SageMaker's /invocations answers as the chat route or the completions route, by the body it was given.
INVOCATION_RESPONSES = {
    200: {"description": "A chat completion when the body has `messages`, else a completion; whole or streamed.",
          "content": {"application/json": {"schema": _either(ChatCompletionResponse, CompletionResponse)},
                      "text/event-stream": _sse("ChatCompletionChunk or CompletionChunk")}},
    **error_responses(400, 401, 404, 408, 413, 503)}


def install_openapi(app: FastAPI) -> None:
    """Serve the document below; routes that check an API key (``requires_api_key``) say they need one."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _replace_validation_errors(schema)
            protected = [route for route in app.routes if getattr(route, "requires_api_key", False)]
            if protected:
                _add_security(schema, protected)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _replace_validation_errors(schema: dict[str, Any]) -> None:
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None and "400" not in responses:
                responses["400"] = {"description": _DESCRIPTIONS[400],
                                    "content": {"application/json": {"schema": error_ref}}}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    assert "ErrorResponse" in components, "every route with a body documents its errors (error_responses)"


def _add_security(schema: dict[str, Any], routes: list[APIRoute]) -> None:
    schemes = {"APIKey": {"type": "http", "scheme": "bearer"}}
    paths = schema.get("paths", {})
    for route in routes:
        operations = paths.get(route.path_format, {})  # the document names a route by its path format
        security = [{"APIKey": []}]
        if getattr(route, "accepts_x_api_key", False):  # the Anthropic routes: either header
            schemes["AnthropicAPIKey"] = {"type": "apiKey", "in": "header", "name": "x-api-key"}
            security.append({"AnthropicAPIKey": []})
        for method in route.methods:
            if method.lower() in operations:
                operations[method.lower()]["security"] = security
    schema["components"]["securitySchemes"] = schemes
