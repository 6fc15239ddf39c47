"""/score, /rerank (and /v1/rerank) and /pooling: vLLM's request and response bodies (Jina's and Cohere's for
rerank), for a server started with ``--runner pooling``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.protocol.common import RequestModel, unix_now
from server.protocol.embeddings import INT32_MAX


class ScoreRequest(RequestModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None  # for the caller's bookkeeping: accepted, not used


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class _ListResponse(BaseModel):
    """vLLM's list answers (/score, /pooling): an id, when, the model, the entries, and the prompt tokens."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=unix_now)
    model: str
    usage: ScoreUsage


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankRequest(RequestModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0, le=INT32_MAX)  # the best n (None or 0: every document)
    return_documents: bool = True  # each result carries its document's text (Jina's and Cohere's field)
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class PoolingRequest(RequestModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float]  # the embedding (normalised), or a classifier's logits


class PoolingResponse(_ListResponse):
    data: list[PoolingData]
