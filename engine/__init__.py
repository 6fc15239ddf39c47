"""minivllm's inference engine: paged KV cache, continuous batching, models and sampling."""

from engine.config import ConfigError, EngineConfig
from engine.llm import LLM, CompletionOutput, RequestOutput
from engine.llm_engine import LLMEngine, RequestError
from engine.sampling_params import SamplingParams, SamplingParamsError

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
]
