"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's own numerics.

What differs from ``engine.models.llama``, each as transformers computes it:

* RMSNorm scales by ``(1 + weight)`` in float32 before casting back (weights start at zero);
* the embedding is multiplied by ``sqrt(hidden_size)``, rounded to the activations' dtype;
* the MLP is GeGLU with tanh-approximated GELU;
* four norms per layer: before and after attention, before and after the MLP (the sums stay outside them);
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5``;
* Gemma 2 soft-caps the attention scores and the final logits (``c * tanh(x / c)``) and alternates sliding
  and global layers; Gemma 3 norms q and k per head and runs its sliding layers (5 of every 6) on their own
  RoPE base.

The sliding windows come from ``ModelConfig.layer_windows`` like Mistral's and Qwen2's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.distributed import kv_head_range, shard_range
from engine.loading.model_config import ModelConfig
from engine.models.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.models.linear import FusedLinear, RowParallelLinear
from engine.models.rotary import RotaryEmbedding, get_rope
from engine.models.weight_loading import load_checkpoint_weights


class GemmaRMSNorm(nn.Module):
    """RMSNorm with a ``(1 + weight)`` scale, computed in float32 and cast back after the scale."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def _soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        gemma = config.gemma
        hd = self.head_dim = config.head_dim
        q_start, self.num_heads = shard_range(config.num_attention_heads)
        kv_start, self.num_kv_heads = kv_head_range(config.num_key_value_heads)
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        kv_rows = (kv_start * hd, self.kv_size)
        self.qkv_proj = FusedLinear(
            config.hidden_size, {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=config.attention_bias,
            source_rows={"q_proj": (q_start * hd, self.q_size), "k_proj": kv_rows, "v_proj": kv_rows},
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, bias=config.attention_bias)
        self.qk_norm = config.qk_norm  # Gemma 3
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        window = config.layer_windows[layer_idx] if config.layer_windows else 0
        # Rope is applied by the attention layer with its KV-cache write (Attention's rope); Gemma 3's norms,
        # which scale by (1 + weight), run before it.
        self.attn = Attention(self.num_heads, hd, self.num_kv_heads, gemma.query_pre_attn_scalar**-0.5, layer_idx,
                              sliding_window=window, softcap=gemma.attn_logit_softcapping or 0.0,
                              rope=rotary_emb.pending())

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q.reshape(n, self.q_size), k.reshape(n, self.kv_size), v, meta, positions))


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        start, size = shard_range(config.intermediate_size)
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size}, bias=False,
                                        source_rows={"gate_proj": (start, size), "up_proj": (start, size)})
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = GemmaAttention(config, rotary_emb, layer_idx)
        self.mlp = GemmaMLP(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rope = get_rope(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        local_rope = rope
        if config.gemma.local_rope is not None:  # Gemma 3: the sliding layers' own base
            theta, scaling = config.gemma.local_rope
            local_rope = get_rope(config.head_dim, config.max_position_embeddings, theta, scaling)
        windows = config.layer_windows or (0,) * config.num_hidden_layers
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, local_rope if windows[i] else rope, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden, meta)
        return self.norm(hidden)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``); see the module docstring."""

    supports_cuda_graphs = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.gemma is None:
            raise ValueError(f"{config.architecture} needs a Gemma config (model_type gemma2 or gemma3_text)")
        self.config = config
        self.model = GemmaModel(config)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _soft_cap(self.lm_head(hidden), self.config.gemma.final_logit_softcapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        return load_checkpoint_weights(self, weights, skip)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
