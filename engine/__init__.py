"""minivllm's inference engine: paged KV cache, continuous batching, models and sampling.

The names below are imported on first use, so that a process that needs only the configuration (the API
server before it starts the engine core) does not pay for torch and the models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "engine.frontend.llm",
    "CompletionOutput": "engine.frontend.llm",
    "RequestOutput": "engine.frontend.llm",
    "EmbeddingRequestOutput": "engine.frontend.llm",
    "PoolingParams": "engine.sampling_params",
    "ConfigError": "engine.config",
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.core.llm_engine",
    "LoRARequest": "engine.lora.request",
    "RequestError": "engine.errors",
    "SamplingParams": "engine.sampling_params",
    "SamplingParamsError": "engine.sampling_params",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import ConfigError, EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.errors import RequestError
    from engine.frontend.llm import LLM, CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from engine.lora.request import LoRARequest
    from engine.sampling_params import PoolingParams, SamplingParams, SamplingParamsError


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
