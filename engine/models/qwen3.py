"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before rope.

Qwen3 configs give ``head_dim`` explicitly, and it need not equal hidden_size / num_heads;
``ModelConfig.head_dim`` carries it through.
"""

from __future__ import annotations

from engine.loading.model_config import ModelConfig
from engine.models.llama import AttentionSpec, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        return AttentionSpec(qkv_bias=config.attention_bias, o_proj_bias=config.attention_bias, qk_norm=True)
