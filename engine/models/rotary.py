"""Rotary position embeddings: the neox-style ``RotaryEmbedding`` (with Llama 3 and linear scaling, and M-RoPE),
and ``PendingRope``, the rope one attention layer's q and k still need, which the KV-cache write applies.

The table and the rounding follow Hugging Face's Llama/Qwen: cos/sin in float32, rounded to the activations'
dtype before they multiply. The Triton kernels of ``engine.ops.fused`` round in the same order.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.models.fused_path import fused_ops, runs_triton
from engine.models.linear.output import sum_partials
from engine.models.norm import RMSNorm

if TYPE_CHECKING:
    from engine.attention.metadata import AttentionMetadata


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate-half, as in HF Llama/Qwen) from a cached cos/sin table.

    Qwen3 passes its per-head ``q_norm``/``k_norm`` to ``forward``, which applies them first:
    on the Triton path, norms and rope are one kernel for q and k together.

    With ``mrope_section`` (M-RoPE, Qwen2.5-VL) every token has three positions, [3, num_tokens]
    (temporal, height, width: equal for text), and the ``head_dim // 2`` frequencies split into
    three runs of those lengths: frequency i turns by the position of the run it is in::

        frequency   0 .. s0-1 | s0 .. s0+s1-1 | s0+s1 .. head_dim/2-1
        position    row 0 (t) | row 1 (h)     | row 2 (w)
    """

    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor,
                 mrope_section: tuple[int, int, int] | None = None):
        super().__init__()
        self.head_dim = head_dim
        # Built on the CPU in float32, like Hugging Face, then moved to wherever the model is being built.
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, head_dim]
        # torch.empty(0) lands on the device of an enclosing `with torch.device(...)`, on every torch >= 2.4.
        target_device = torch.empty(0).device
        # Not persistent: it is derived from the config, never read from a checkpoint.
        self.register_buffer("cos_sin_cache", cache.to(target_device), persistent=False)
        self.mrope_section = tuple(mrope_section) if mrope_section is not None else None
        if self.mrope_section is not None:
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != head_dim // 2:
                raise ValueError(f"mrope_section must be three lengths adding up to head_dim // 2 = {head_dim // 2}, "
                                 f"got {self.mrope_section}")
            # The position row each column of the table reads: [head_dim], cos columns then sin columns.
            rows = torch.repeat_interleave(torch.arange(3), torch.tensor(self.mrope_section)).repeat(2)
            self.register_buffer("mrope_rows", rows.to(target_device), persistent=False)
        self.use_triton: bool | None = None  # engine.models.fused_path

    def pending(self, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> PendingRope:
        """This rope (after Qwen3's per-head norms, both or neither) as one attention layer's q and k will need it:
        handed to the layer (``Attention``'s ``rope``), which applies it with the KV-cache write."""
        return PendingRope(self, q_norm, k_norm)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64; [3, num_tokens] with mrope_section
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]; rows may be strided (a view of qkv)
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        q_norm: RMSNorm | None = None,  # per-head norms applied before rope, both or neither
        k_norm: RMSNorm | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,  # ``cos_sin(positions)``, where made already
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope on its own: the models hand it to attention instead (``pending``), whose Triton path applies it in
        the KV-cache write; this is the path of ``PendingRope.apply`` (the torch attention backend)."""
        if runs_triton(self.use_triton, q):
            if q_norm is None:
                return fused_ops().rotary(positions, q, k, self.cos_sin_cache, self.mrope_section)
            # Both norms are built from the same config eps (LlamaAttention), so one eps serves both.
            return fused_ops().qk_norm_rotary(
                positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, self.cos_sin_cache, self.mrope_section
            )
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' cos and sin, [num_tokens, 1, head_dim // 2] each, in ``dtype``."""
        if self.mrope_section is None:
            cos_sin = self.cos_sin_cache[positions]  # [num_tokens, head_dim]
        else:  # column j of token t: the table's row positions[mrope_rows[j], t]
            cos_sin = self.cos_sin_cache.gather(0, positions[self.mrope_rows].T)
        # The table stays float32; cos/sin are rounded to the activation dtype as Hugging Face does.
        cos, sin = cos_sin.to(dtype).chunk(2, dim=-1)  # [num_tokens, head_dim // 2] each
        return cos[:, None, :], sin[:, None, :]


@dataclass(frozen=True)
class PendingRope:
    """What one attention layer's q and k still need after the q|k|v projection: rope (``rotary``), after Qwen3's
    per-head RMSNorms where ``q_norm``/``k_norm`` are given; and, for one step, the tokens' ``positions``, the
    ``column_scales`` (float32 [q_size + 2 * kv_size]) the FP8 product has not applied to q|k|v's columns yet
    (``LinearOutput.column_scales``), which come first, and before them the ``partials`` of a product cut along K
    (``LinearOutput.partials``; [num_slices, num_tokens, q_size + 2 * kv_size]), whose sum q|k|v is: the q, k and
    v handed over with it are then views of the first slice.

    ``RotaryEmbedding.pending`` makes one per layer (``Attention``'s ``rope``); ``at`` gives a step's. The Triton
    attention backend applies it in the launch that writes the KV cache (``write_paged_kv``'s ``rope``, which reads
    the properties below); ``apply`` is the same arithmetic op by op, for the torch backend."""

    rotary: RotaryEmbedding
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    positions: torch.Tensor | None = None  # [num_tokens] int64; [3, num_tokens] with M-RoPE
    column_scales: torch.Tensor | None = None
    partials: torch.Tensor | None = None

    def at(self, positions: torch.Tensor, column_scales: torch.Tensor | None = None,
           partials: torch.Tensor | None = None) -> PendingRope:
        """This layer's rope for one step's tokens."""
        return dataclasses.replace(self, positions=positions, column_scales=column_scales, partials=partials)

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        return self.rotary.cos_sin_cache

    @property
    def mrope_section(self) -> tuple[int, int, int] | None:
        return self.rotary.mrope_section

    @property
    def q_weight(self) -> torch.Tensor | None:
        return self.q_norm.weight if self.q_norm is not None else None

    @property
    def k_weight(self) -> torch.Tensor | None:
        return self.k_norm.weight if self.k_norm is not None else None

    @property
    def eps(self) -> float:
        # Both norms are built from the same config eps (LlamaAttention), so one eps serves both.
        return self.q_norm.eps if self.q_norm is not None else 0.0

    def apply(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              meta: AttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) [num_tokens, heads, head_dim] added up from the partial products, with the column scales applied
        (each product rounded to the model dtype, as ``fp8_kernels.scale_columns_`` rounds it), then q and k normed
        and roped (``RotaryEmbedding``). With the step's ``meta``, the tokens' cos and sin are made once a step, for
        every layer (``AttentionMetadata.derive``)."""
        if self.partials is not None:
            whole = sum_partials(self.partials)
            q, k, v = (part.view(x.shape) for x, part in
                       zip((q, k, v), whole.split([x.shape[1] * x.shape[2] for x in (q, k, v)], dim=-1)))
        if self.column_scales is not None:
            widths = [x.shape[1] * x.shape[2] for x in (q, k, v)]
            q, k, v = ((x.float() * s.view(x.shape[1:])).to(x.dtype)
                       for x, s in zip((q, k, v), self.column_scales.split(widths)))
        cos_sin = None
        if meta is not None:
            rotary, positions, dtype = self.rotary, self.positions, q.dtype
            cos_sin = meta.derive(("rope", id(rotary), dtype), lambda: rotary.cos_sin(positions, dtype))
        q, k = self.rotary(self.positions, q, k, self.q_norm, self.k_norm, cos_sin)
        return q, k, v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, heads, head_dim // 2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def get_rope(
    head_dim: int, max_position: int, theta: float, rope_scaling: dict[str, Any] | None = None,
    mrope_section: tuple[int, int, int] | None = None,
) -> RotaryEmbedding:
    """Rotary embedding for a normalised ``ModelConfig.rope_scaling`` (None, linear or llama3), M-RoPE with
    an ``mrope_section`` (``ModelConfig.mrope_section``)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    rope_type = rope_scaling["rope_type"] if rope_scaling else None
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif rope_type is not None:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    return RotaryEmbedding(head_dim, max_position, inv_freq, mrope_section)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: slow the low frequencies by ``factor``, keep the high ones, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, blended, scaled)
