"""/v1/models: the served model's card."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.protocol.common import unix_now


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "minivllm"
    root: str | None = None
    max_model_len: int | None = None
    # What prompts may carry: ["text"], or ["text", "image"] for a model that takes images.
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])
    # What the model serves: "generate" (completions, chat, messages) or "pooling" (embeddings).
    runner: Literal["generate", "pooling"] = "generate"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
