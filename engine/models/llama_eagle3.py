"""The EAGLE-3 draft head of a Llama-family target (vLLM's ``Eagle3LlamaForCausalLM``, SGLang's
``LlamaForCausalLMEagle3``): one Llama decoder layer that reads a token and a hidden state at each position.

At the target's position t the head takes the embedding of token t + 1 and the target's hidden state at t, and its
output there predicts token t + 2::

    aux [tokens, n * target_hidden]   the target's residual stream entering n of its layers (LlamaModel.forward)
    fc(aux) = hidden [tokens, hidden]  the head's hidden input at the target's positions
    midlayer    q|k|v of [input_layernorm(embed(token t + 1)) | hidden_norm(hidden)]  (2 * hidden inputs), paged
                attention roped at t, o; the residual is the hidden input (or its norm: norm_before_residual);
                then the post-attention add-norm and SwiGLU MLP as in any Llama layer
    norm        (normed, prenorm): lm_head(normed) [draft_vocab] -> argmax, a draft id; its target id is
                draft id + d2t[draft id]; prenorm (the residual stream after the layer) is the hidden input of
                the next position when the head chains its own proposals (there is no target state for them)

The token embeddings are the target's unless the checkpoint has its own (``embed_tokens``): the caller embeds the
tokens and hands the rows in, so the head holds no reference to the target. Its K/V live in its own one-layer paged
cache (``engine.worker.eagle3``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.loading.model_config import ModelConfig
from engine.models.embedding import VocabParallelEmbedding
from engine.models.linear import FusedLinear
from engine.models.llama import AttentionSpec, LlamaAttention, LlamaMLP
from engine.models.norm import RMSNorm
from engine.models.rotary import get_rope
from engine.models.weight_loading import load_checkpoint_weights


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int, norm_before_residual: bool):
        super().__init__()
        rope = get_rope(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        spec = AttentionSpec(qkv_bias=config.attention_bias, o_proj_bias=config.attention_bias, qk_norm=False)
        self.self_attn = LlamaAttention(config, spec, rope, layer_idx=0)
        attn = self.self_attn  # q, k and v read the normed embedding and the normed hidden state side by side
        attn.qkv_proj = FusedLinear(2 * config.hidden_size, {"q_proj": attn.q_size, "k_proj": attn.kv_size,
                                                             "v_proj": attn.kv_size}, bias=config.attention_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64: the target positions t
        embeds: torch.Tensor,  # [num_tokens, hidden]: the embeddings of tokens t + 1
        hidden: torch.Tensor,  # [num_tokens, hidden]: fc of the target's states, or the head's own prenorm rows
        meta: AttentionMetadata,
    ):  # (the MLP's product, a LinearOutput [num_tokens, hidden], and the residual [num_tokens, hidden])
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        out = self.self_attn(positions, torch.cat([embeds, hidden], dim=-1), meta)  # [num_tokens, 2 * hidden] in
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class LlamaEagle3Head(nn.Module):
    """The head's layers, named as the checkpoint names them (``midlayer.*``, ``fc``, ``norm``, ``lm_head``,
    ``embed_tokens`` where it has its own); ``d2t`` [draft_vocab] int64 is loaded beside them."""

    def __init__(self, config: ModelConfig, target_hidden_size: int, num_aux_layers: int, draft_vocab_size: int,
                 norm_before_residual: bool, own_embeddings: bool, max_position: int):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(num_aux_layers * target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, max_position, norm_before_residual)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, draft_vocab_size, bias=False)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if own_embeddings else None
        # Each draft id's offset to its target id (vLLM's draft_id_to_target_id); zeros: the same vocabulary.
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's states at its positions [tokens, n * target_hidden] -> the head's hidden input."""
        return self.fc(aux)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, prenorm) [num_tokens, hidden] each: the rows the LM head reads, and the residual stream after
        the layer, which the next chained position takes as its hidden input."""
        out, residual = self.midlayer(positions, embeds, hidden, meta)
        return self.norm(out, residual)

    def propose(self, normed: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over the draft vocabulary, as a target token id [rows] int64."""
        draft = self.lm_head(normed).argmax(dim=-1)
        return draft + self.d2t[draft]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the checkpoint's tensors as the head names them (``d2t`` apart); return the names used."""
        return load_checkpoint_weights(self, weights)

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]
