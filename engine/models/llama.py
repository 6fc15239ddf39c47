"""Llama-family decoder (Llama 2/3, Mistral without sliding window, SmolLM2), the base of Qwen2/Qwen3.

Module and parameter names mirror Hugging Face's, except for two fused projections:
``self_attn.qkv_proj`` (q | k | v) and ``mlp.gate_up_proj`` (gate | up). ``load_weights``
fills them from the separate checkpoint tensors.

Variants differ only in their ``AttentionSpec`` (biases, q/k norm); Qwen2 and Qwen3
subclass ``LlamaForCausalLM`` and override ``attention_spec``.

Each projection's product is handed on as a ``LinearOutput`` (``forward_deferred``): the kernel that reads it
next (the KV-cache write after q|k|v, the residual add-norms after o and down, SwiGLU after gate|up) does its
last elementwise step as it reads it, and each of those kernels writes its output as the next projection takes
it (``takes_fp8_input``). How a projection holds and multiplies its weight is its weight method's
(``engine.models.linear``), chosen by the loader.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.distributed import kv_head_range, shard_range
from engine.loading.model_config import ModelConfig
from engine.models.activation import SiluAndMul
from engine.models.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.models.linear import FusedLinear, LinearOutput, RowParallelLinear
from engine.models.norm import RMSNorm
from engine.models.rotary import RotaryEmbedding, get_rope
from engine.models.weight_loading import load_checkpoint_weights


@dataclass(frozen=True)
class AttentionSpec:
    """The per-architecture knobs of the attention block."""

    qkv_bias: bool  # bias on the q/k/v projections
    o_proj_bias: bool  # bias on the output projection
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)


class LlamaAttention(nn.Module):
    # q|k|v's product is finished by the attention layer's KV-cache write, o's by the next residual add-norm
    # (LinearBase.forward_deferred).
    deferred_products = ("qkv_proj", "o_proj")

    def __init__(
        self, config: ModelConfig, spec: AttentionSpec, rotary_emb: RotaryEmbedding, layer_idx: int
    ):
        super().__init__()
        # With tensor parallelism this rank computes some of the heads (shard_range, kv_head_range).
        hd = self.head_dim = config.head_dim
        q_start, self.num_heads = shard_range(config.num_attention_heads)
        kv_start, self.num_kv_heads = kv_head_range(config.num_key_value_heads)
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        kv_rows = (kv_start * hd, self.kv_size)
        self.qkv_proj = FusedLinear(
            config.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=spec.qkv_bias,
            source_rows={"q_proj": (q_start * hd, self.q_size), "k_proj": kv_rows, "v_proj": kv_rows},
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, bias=spec.o_proj_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.rotary_emb = rotary_emb  # shared by every layer; its table is a non-persistent buffer
        window = config.layer_windows[layer_idx] if config.layer_windows else 0
        # Qwen3 norms each head of q and k before rope. The attention layer applies both with its KV-cache write:
        # with a 16-bit cache on the GPU norms, rope and the write are one kernel.
        rope = rotary_emb.pending(self.q_norm, self.k_norm) if spec.qk_norm else rotary_emb.pending()
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, layer_idx,
                              sliding_window=window, rope=rope)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]; [3, num_tokens] for M-RoPE (ModelConfig.mrope_section)
        hidden: torch.Tensor,  # [num_tokens, hidden_size], or as q|k|v takes it (LinearBase.takes_fp8_input)
        meta: AttentionMetadata,
    ) -> LinearOutput:  # [num_tokens, hidden_size]: o's product, which the next add-norm finishes
        # [num_tokens, q_size + 2 * kv_size], finished as attention writes K and V (and ropes q and k)
        qkv = self.qkv_proj.forward_deferred(hidden, partials_ok=self.attn.takes_partial_products)
        q, k, v = qkv.values.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(q, k, v, meta, positions, qkv.column_scales, fp8_out=self.o_proj.takes_fp8_input,
                        partials=qkv.partials)  # [num_tokens, q_size]
        return self.o_proj.forward_deferred(out)


class LlamaMLP(nn.Module):
    # gate|up's product is finished by SwiGLU, down's by the next residual add-norm (LinearBase.forward_deferred).
    deferred_products = ("gate_up_proj", "down_proj")

    def __init__(self, config: ModelConfig):
        super().__init__()
        start, size = shard_range(config.intermediate_size)  # this rank's columns (column-parallel)
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size}, bias=False,
                                        source_rows={"gate_proj": (start, size), "up_proj": (start, size)})
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    @property
    def takes_fp8_input(self) -> bool:
        return self.gate_up_proj.takes_fp8_input

    def forward(self, x: torch.Tensor) -> LinearOutput:  # x: [num_tokens, hidden_size], or as gate|up takes it
        gate_up = self.gate_up_proj.forward_deferred(x)  # [num_tokens, 2 * intermediate]
        hidden = self.act_fn(gate_up, fp8_out=self.down_proj.takes_fp8_input)  # [num_tokens, intermediate]
        return self.down_proj.forward_deferred(hidden)  # [num_tokens, hidden_size], for the next add-norm


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: AttentionSpec, rotary_emb: RotaryEmbedding, layer_idx: int,
                 mlp: nn.Module):
        super().__init__()
        self.self_attn = LlamaAttention(config, spec, rotary_emb, layer_idx)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor | LinearOutput,  # [num_tokens, hidden_size]: the embeddings, or the last block's
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None for the first layer
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor | LinearOutput, torch.Tensor]:
        """(hidden, residual). The residual add of the previous block is fused into this block's first norm, which
        finishes that block's last product; each norm writes its output as the next projection takes it."""
        fp8_qkv = self.self_attn.qkv_proj.takes_fp8_input
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, fp8_out=fp8_qkv)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, fp8_out=fp8_qkv)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, fp8_out=self.mlp.takes_fp8_input)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, spec: AttentionSpec, make_mlp=None):
        super().__init__()
        make_mlp = make_mlp or (lambda config, layer_idx: LlamaMLP(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
            config.mrope_section,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, spec, rotary_emb, i, make_mlp(config, i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final-normed hidden states [num_tokens, hidden_size]; with ``aux_layers`` (ascending layer indices)
        also the residual stream entering each of those layers, side by side: [num_tokens, len * hidden_size]
        (an EAGLE-3 head reads them, ``engine.models.llama_eagle3``)."""
        # [num_tokens, hidden_size]: the token embeddings, or the caller's (a vision model's prompt images in them)
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        aux = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:  # the stream entering layer i: the last block's product added to the residual
                aux.append(hidden if residual is None else _finished(hidden) + residual)
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return (hidden, torch.cat(aux, dim=-1)) if aux_layers else hidden


class LlamaForCausalLM(nn.Module):
    """A causal LM over a flat token batch; see ``engine.attention.metadata`` for the layout."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_spec(config), self.make_mlp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention_spec(cls, config: ModelConfig) -> AttentionSpec:
        return AttentionSpec(qkv_bias=config.attention_bias, o_proj_bias=config.attention_bias, qk_norm=False)

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer ``layer_idx`` (mixture-of-experts models override it)."""
        return LlamaMLP(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size], in place of the ids' embeddings
        aux_layers: tuple[int, ...] = (),  # ascending layer indices whose input an EAGLE-3 head reads
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final-normed hidden states, [num_tokens, hidden_size]; with ``aux_layers``, also the residual stream
        entering those layers (``LlamaModel.forward``)."""
        return self.model(input_ids, positions, meta, inputs_embeds, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype for the given hidden rows: [n, hidden_size] -> [n, vocab_size].

        The sampler upcasts them to float32 where it computes with them; greedy rows only need
        their argmax, which bfloat16 gives exactly, at a third of the memory traffic.
        """
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``compute_logits(hidden)`` without computing them, where the LM head holds a
        quantized copy that finds it (``ParallelLMHead.greedy_tokens``); None elsewhere."""
        return self.lm_head.greedy_tokens(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors (any dtype/device); return the names used.

        ``lm_head.weight`` is skipped when the embeddings are tied.
        """
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        return load_checkpoint_weights(self, weights, skip)

    def attention_layers(self) -> list[Attention]:
        """The paged-attention layers in layer order, for binding KV caches and the backend."""
        return [layer.self_attn.attn for layer in self.model.layers]


def _finished(hidden: torch.Tensor | LinearOutput) -> torch.Tensor:
    """A block's output as a tensor: a deferred product finished as the next add-norm would finish it."""
    return hidden.finished() if isinstance(hidden, LinearOutput) else hidden
