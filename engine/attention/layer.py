"""The attention layer that models use: it owns its view of the paged KV cache and a backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.models.rotary import PendingRope


class Attention(nn.Module):
    """Paged attention for one decoder layer.

    The KV cache is bound after the pool is sized (``bind_kv_cache``), by layer index;
    the backend is chosen by the model runner (``set_backend``). Both are plain
    attributes set once, never looked up by duck typing. Once both are set the backend binds
    the cache (``backend.bind``): the Triton backend checks the cache and this layer's
    configuration there, once, and its steps' launches check nothing more.

    ``rope``: the rotary embedding (with Qwen3's q/k norms) that the q and k handed to ``forward`` still need,
    from ``RotaryEmbedding.pending``. The backend applies it with the KV-cache write (on the Triton path with a
    16-bit cache in the same kernel launch); the model runner compiles that write's variants before the first step.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, layer_idx: int,
                 sliding_window: int = 0, softcap: float = 0.0, rope: PendingRope | None = None):
        super().__init__()
        self.rope = rope
        self.sliding_window = sliding_window  # a query sees only the last this-many positions; 0: all
        self.softcap = softcap  # scores become softcap * tanh(scores / softcap) (Gemma 2); 0: off
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        # An FP8 cache's (k_scales, v_scales), each [num_blocks, block_size, num_kv_heads] float32; else None.
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.backend = None
        self.bound_cache = None  # the backend's binding of the cache (``backend.bind``), which ``forward`` hands it

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.k_cache, self.v_cache, self.kv_scales = k_cache, v_cache, kv_scales
        self._bind()

    def set_backend(self, backend) -> None:
        self.backend = backend
        self._bind()

    def _bind(self) -> None:
        if self.backend is not None and self.k_cache is not None:
            self.bound_cache = self.backend.bind(self.k_cache, self.v_cache, self.num_heads, self.scale,
                                                 self.kv_scales, self.sliding_window, self.softcap, self.rope)

    @property
    def takes_partial_products(self) -> bool:
        """Whether ``forward`` takes q|k|v as partial products (``partials``): a layer that ropes q and k with the
        write of a 16-bit cache, whose kernel adds them as it reads them on the Triton backend (the torch backend
        adds them first)."""
        return self.rope is not None and self.k_cache is not None and self.kv_scales is None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,
        meta: AttentionMetadata,
        positions: torch.Tensor | None = None,  # [num_tokens] int64, [3, num_tokens] with M-RoPE: ``rope``'s
        column_scales: torch.Tensor | None = None,  # float32 [q_size + 2 * kv_size]: see below
        fp8_out: bool = False,
        partials: torch.Tensor | None = None,  # [num_slices, num_tokens, q_size + 2 * kv_size]: see below
    ):  # [num_tokens, num_heads * head_dim], a tensor or an Fp8Activation
        """Attention of q over the cached context and the new K/V, which are written to the cache first.

        With a ``rope``, q and k (views of the q|k|v projection's output, rows of any stride) are not roped yet:
        the backend ropes them at ``positions``. ``column_scales``: the per-column FP8 weight scales the q|k|v
        product left to be applied (``Fp8LinearMethod.apply_deferred``), applied to q, k and v first.
        ``partials`` (where ``takes_partial_products``): the q|k|v product cut along K (``linear.ksplit``), q, k
        and v being views of its first slice; the slices are added before anything else.

        ``fp8_out``: the caller's output projection takes an ``Fp8Activation`` (``LinearBase.takes_fp8_input``);
        the backend then returns one where its decode kernels can quantize the output (decode-only steps with split
        contexts, heads 128 wide), and the plain output elsewhere."""
        if self.bound_cache is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache or backend bound")
        rope = None
        if self.rope is not None:
            if positions is None:
                raise ValueError(f"attention layer {self.layer_idx} ropes q and k: it needs the tokens' positions")
            rope = self.rope.at(positions, column_scales, partials)
        elif column_scales is not None or partials is not None:
            raise ValueError(f"attention layer {self.layer_idx}: column_scales and partials are applied with a rope "
                             f"only")
        if partials is not None and self.kv_scales is not None:
            raise ValueError(f"attention layer {self.layer_idx}: partial products of q|k|v need a 16-bit KV cache")
        n = q.shape[0]
        out = self.backend.forward(
            self.bound_cache,
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
            meta,
            fp8_out=fp8_out,
            rope=rope,
        )
        if isinstance(out, tuple):
            from engine.models.fp8 import Fp8Activation

            return Fp8Activation(*out, n, q.dtype)
        return out.view(n, self.num_heads * self.head_dim)
