"""/v1/models: the served model's card and its LoRA adapters'; the bodies that load and unload adapters."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.protocol.common import RequestModel, unix_now


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "minivllm"
    root: str | None = None  # a LoRA adapter's: its path
    parent: str | None = None  # a LoRA adapter's: the model it adapts (null for the served model itself)
    max_model_len: int | None = None
    # What prompts may carry: ["text"], or ["text", "image"] for a model that takes images.
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])
    # What the model serves: "generate" (completions, chat, messages) or "pooling" (embeddings).
    runner: Literal["generate", "pooling"] = "generate"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's ``POST /v1/load_lora_adapter``: serve the PEFT adapter at ``lora_path`` as model ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """vLLM's ``POST /v1/unload_lora_adapter``: the adapter by its name, or by the id it was given."""

    lora_name: str | None = None
    lora_int_id: int | None = None
