"""The OpenAI wire format: pydantic models for every request and response body.

Nothing a request carries is silently ignored: a field is implemented, or a 400 names it
(unknown fields too, as OpenAI does), except OpenAI's metadata-only fields in
``METADATA_FIELDS``, accepted and not used. Types are strict: ``"n": "2"`` is a 400, not a
silent 2. Value ranges are checked once, by ``SamplingParams``; the bounds here only keep
numbers inside what the engine's arrays hold.

    common.py       strict request models, usage, prompt logprobs, per-request metrics
    sampling.py     the sampling fields completions and chat share -> SamplingParams
    completions.py  /v1/completions          chat.py  /v1/chat/completions (messages, tools)
    tokenize.py     /tokenize, /detokenize   models.py  /v1/models

Every model is importable from here (``from server.protocol import ChatCompletionRequest``).
"""

from __future__ import annotations

from server.protocol.chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatMessageParam,
    ChatStreamChoice,
    ContentPart,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    FunctionCallParam,
    FunctionDefinition,
    ImageURL,
    MessageContent,
    MessageModel,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolCallParam,
    ToolParam,
    TopLogprob,
)
from server.protocol.common import (
    METADATA_FIELDS,
    OmitNone,
    PerRequestMetrics,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    RequestModel,
    UsageInfo,
)
from server.protocol.completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
)
from server.protocol.models import ModelCard, ModelList
from server.protocol.sampling import (
    MAX_N,
    JSONSchemaFormat,
    ResponseFormat,
    SamplingRequest,
    StreamOptions,
    StructuredOutputsRequest,
)
from server.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

__all__ = [
    "ChatChoice", "ChatCompletionChunk", "ChatCompletionRequest", "ChatCompletionResponse", "ChatLogprobToken",
    "ChatLogprobs", "ChatMessage", "ChatMessageParam", "ChatStreamChoice", "CompletionChoice", "CompletionChunk",
    "CompletionLogprobs", "CompletionRequest", "CompletionResponse", "CompletionStreamChoice", "ContentPart",
    "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "DetokenizeRequest", "DetokenizeResponse", "FunctionCall",
    "FunctionCallParam", "FunctionDefinition", "ImageURL", "JSONSchemaFormat", "MAX_N", "METADATA_FIELDS",
    "MessageContent", "MessageModel", "ModelCard", "ModelList", "NamedFunction", "NamedToolChoice", "OmitNone",
    "PerRequestMetrics", "PromptLogprob", "PromptLogprobs", "PromptTokensDetails", "RequestModel", "ResponseFormat",
    "SamplingRequest", "StreamOptions", "StructuredOutputsRequest", "TokenizeRequest", "TokenizeResponse",
    "ToolCall", "ToolCallParam", "ToolParam", "TopLogprob", "UsageInfo",
]
