"""Qwen2 (and Qwen2.5): the Llama decoder with biases on q/k/v but not on the output projection."""

from __future__ import annotations

from engine.loading.model_config import ModelConfig
from engine.models.llama import AttentionSpec, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        return AttentionSpec(qkv_bias=True, o_proj_bias=False, qk_norm=False)
