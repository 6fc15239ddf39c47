"""/tokenize and /detokenize: their requests and responses."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from server.protocol.chat import ChatMessageParam, ToolParam
from server.protocol.common import RequestModel


class TokenizeRequest(RequestModel):
    """Either a ``prompt`` (text) or chat ``messages`` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    chat_template: str | None = None
    tools: list[ToolParam] | None = None  # with messages: rendered as a chat completion would render them
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs (else null): each token as the vocabulary writes it


class DetokenizeResponse(BaseModel):
    prompt: str
