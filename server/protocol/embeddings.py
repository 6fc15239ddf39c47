"""/v1/embeddings: OpenAI's request and response (a server started with ``--runner pooling``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.protocol.common import RequestModel

INT32_MAX = 2**31 - 1


class EmbeddingRequest(RequestModel):
    model: str | None = None
    # A string, strings, token ids, or lists of token ids: one embedding each.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    # A Matryoshka model's leading dimensions (a 400 for a model that was not trained for them).
    dimensions: int | None = Field(default=None, ge=1, le=INT32_MAX)
    user: str | None = None  # for the caller's bookkeeping: accepted, not used


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # The vector, or with encoding_format "base64" its little-endian float32 bytes in base64 (what OpenAI's SDK
    # decodes).
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
