"""Building blocks shared by the decoder models: norms, rotary embeddings, fused linears, weight loading.

The numerics follow Hugging Face's Llama/Qwen implementations step by step (including where
they cast between float32 and the model dtype), so that our logits match theirs closely in
float32 and bfloat16 alike.

``RMSNorm``, ``SiluAndMul`` and ``RotaryEmbedding`` each have two paths: the torch code here,
the reference (CPU tests compare it with transformers), and a fused Triton kernel from
``engine.ops.fused`` that rounds in the same order. Each module's ``use_triton``
picks one: ``None`` (the default) means Triton for CUDA tensors when triton is installed,
torch otherwise; ``set_use_triton`` forces one path on a whole model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_gather_last_dim, all_reduce, shard_range, tp_size


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(setting: bool | None, x: torch.Tensor) -> bool:
    """A module's ``use_triton`` resolved for input ``x``: ``None`` means CUDA tensors (with triton installed)."""
    return (x.is_cuda and _triton_installed()) if setting is None else setting


def _fused_ops():
    # Imported on first use so that the torch path never needs triton.
    from engine.ops import fused as fused_ops

    return fused_ops


DECODE_KSPLIT_MAX_ROWS = 256  # decode-sized batches: the products that read their weight for few tokens
# The products whose next kernel adds partial products as it reads them: q|k|v (the rope and KV-cache write of a
# 16-bit cache), o and down (the residual add-norm, RMSNorm), gate|up (SwiGLU, SiluAndMul).
DECODE_KSPLIT_PRODUCTS = ("qkv", "o", "gate_up", "down")


DECODE_KSPLIT_AUTO_MAX = 4  # "auto" cuts K into at most this many slices


def auto_k_slices(in_features: int, out_features: int, device: torch.device) -> int:
    """``MINIVLLM_DECODE_KSPLIT=auto`` (the default): the slice count for a product of a [out_features, in_features]
    weight on ``device``. On a GPU, a product whose K is at least its output's width (o and down) has few output
    tiles at decode sizes: ~2 x out_features / 128 programs of 128 x 128 for up to 256 tokens, far fewer than the
    SMs, each running the whole of K. It is cut into the most slices, a power of two up to
    ``DECODE_KSPLIT_AUTO_MAX``, that keeps the programs within one per SM. Measured on an H100 (bench/RESULTS.md,
    2026-12-05): that picks o=4, down=4 on Qwen3-0.6B and o=2, down=2 on Llama-3.1-8B, the best counts
    ``bench/decode_gemm.py --ksplit`` found, and shortens W1's decode step by 1.1% and 1.3%; q|k|v and gate|up,
    wider than their K, gained nothing cut. Elsewhere (CPU) nothing is cut."""
    if device.type != "cuda" or in_features < out_features:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = 2 * -(-out_features // 128)
    slices = 1
    while (slices < DECODE_KSPLIT_AUTO_MAX and tiles * slices * 2 <= sms
           and in_features % (64 * slices * 2) == 0):
        slices *= 2
    return slices


def decode_k_split_setting() -> str:
    """``MINIVLLM_DECODE_KSPLIT`` as read (spaces dropped, lower case), ``auto`` where unset or empty."""
    return os.environ.get("MINIVLLM_DECODE_KSPLIT", "auto").replace(" ", "").lower() or "auto"


def decode_k_slices(product: str, in_features: int, out_features: int | None = None,
                    device: torch.device | None = None) -> int:
    """``MINIVLLM_DECODE_KSPLIT``: how many slices of K ``product`` (one of ``DECODE_KSPLIT_PRODUCTS``) is cut into
    for decode-sized batches (``DecodeKSplit``); 1 for none. The setting is ``auto`` (the default:
    ``auto_k_slices`` for the weight's shape and device; whole where those are not given), one count for every such
    product (``2``), or counts by product (``qkv=2,o=4,gate_up=2,down=4``; a product not named stays whole); 0 and 1
    mean none. A count that does not cut ``in_features`` into multiples of 64 columns leaves that product whole. An
    unknown product or a count outside 0-16 is an error."""
    if product not in DECODE_KSPLIT_PRODUCTS:
        raise ValueError(f"decode_k_slices: no K-split for product {product!r} (one of {DECODE_KSPLIT_PRODUCTS})")
    value = decode_k_split_setting()
    if value == "auto":
        return 1 if out_features is None or device is None else auto_k_slices(in_features, out_features, device)
    if value.isdigit():
        counts = dict.fromkeys(DECODE_KSPLIT_PRODUCTS, value)
    else:
        counts = {}
        for item in value.split(","):
            name, _, count = item.partition("=")
            if name not in DECODE_KSPLIT_PRODUCTS or name in counts:
                raise ValueError(f"MINIVLLM_DECODE_KSPLIT: {name!r} is not a product that can be cut along K or is "
                                 f"named twice (products: {', '.join(DECODE_KSPLIT_PRODUCTS)}), in {value!r}")
            counts[name] = count
    for name, count in counts.items():
        if not count.isdigit() or int(count) > 16:
            raise ValueError(f"MINIVLLM_DECODE_KSPLIT must be auto or give slice counts from 0 to 16 (one count, or "
                             f"product=count pairs such as qkv=2,o=4,gate_up=2,down=4), got {count!r} for {name}")
    slices = int(counts.get(product, "1"))
    return slices if slices > 1 and in_features % (64 * slices) == 0 else 1


@dataclass
class PartialSums:
    """A product left as the products of K's slices, ``slices`` [num_slices, tokens, out_features] in the model
    dtype, each rounded once: its value is their sum. The residual add-norm that reads it adds them (in float32,
    rounded to the model dtype once, as a whole product is) before the residual (``RMSNorm.forward``)."""

    slices: torch.Tensor

    def total(self) -> torch.Tensor:
        """The product itself, [tokens, out_features]."""
        return self.slices.float().sum(0).to(self.slices.dtype)


def k_slice_products(x: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """``x @ weight.T`` ([tokens, K] x [out, K]) as the products of ``slices`` slices of K, [slices, tokens, out], in
    one strided-batched matmul of views (no copy): slice s is columns s*K/slices.. of x's rows and of the weight's."""
    k = x.shape[1]
    a = x.unflatten(1, (slices, k // slices)).transpose(0, 1)  # [slices, tokens, k / slices]
    w = weight.unflatten(1, (slices, k // slices)).permute(1, 2, 0)  # [slices, k / slices, out]
    return torch.bmm(a, w)


class DecodeKSplit:
    """What the linears whose decode-sized products may be cut along K share (``MINIVLLM_DECODE_KSPLIT``): such a
    product comes back as the ``PartialSums`` of ``k_slices`` slices, one strided-batched cuBLAS product with more
    programs and shorter K loops than the whole product of few tokens has, for the kernel that reads the product next
    to add up (the KV-cache write after q|k|v, the residual add-norm after o and down, SwiGLU after gate|up). 16-bit
    weights without a bias only."""

    k_slices: int = 1
    k_split: str | None = None  # the product's name in the setting (DECODE_KSPLIT_PRODUCTS)

    def read_k_split(self, product: str | None, in_features: int) -> None:
        """Name this layer's product and read its slice count from the setting (when the model is built)."""
        self.k_split = product
        self.k_slices = (decode_k_slices(product, in_features, self.weight.shape[0], self.weight.device)
                         if product else 1)

    @property
    def cuts_along_k(self) -> bool:
        """Whether this layer's decode-sized products are cut (16-bit weights without a bias, slices set)."""
        return self.k_slices > 1 and self.bias is None and not self.is_fp8

    def splits_along_k(self, x) -> bool:
        """Whether this layer's product of ``x`` comes back as ``PartialSums``."""
        return (self.cuts_along_k and isinstance(x, torch.Tensor) and x.dim() == 2
                and x.shape[0] <= DECODE_KSPLIT_MAX_ROWS)

    def partial_products(self, x: torch.Tensor) -> PartialSums:
        """``x @ W.T`` as the products of ``k_slices`` slices of K (``k_slice_products``)."""
        return PartialSums(k_slice_products(x, self.weight, self.k_slices))


def decode_k_split_summary(model: nn.Module) -> str:
    """The model's products cut along K and into how many slices, for the start-up log: "" for none, else e.g.
    "o: 4 slices, down: 4 slices" (a product cut into different counts in different layers lists each)."""
    cuts: dict[str, set[int]] = {}
    for module in model.modules():
        if isinstance(module, DecodeKSplit) and module.cuts_along_k:
            cuts.setdefault(module.k_split, set()).add(module.k_slices)
    return ", ".join(f"{name}: {'/'.join(map(str, sorted(cuts[name])))} slices"
                     for name in DECODE_KSPLIT_PRODUCTS if name in cuts)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, optionally fused with the residual add.

    ``forward(x)`` returns the normed ``x``. ``forward(x, residual)`` first forms
    ``x + residual`` and returns ``(normed, x + residual)``: the sum is the residual
    stream the next layer adds to.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton: bool | None = None  # see the module docstring

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8_out: bool = False,
        column_scales: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``fp8_out``: the caller's next layer takes an ``Fp8Activation`` (``Fp8Weights.takes_fp8_input``); the
        Triton path then returns one, quantized as the layer would quantize the normed rows, in the same kernel.
        The torch path returns the normed rows either way. ``column_scales`` (float32 [hidden]): the scales that
        ``x``'s columns still need (an FP8 product that left its per-channel weight scales to this norm,
        ``RowParallelLinear.forward_deferring_scales``), each product rounded to ``x``'s dtype before the add.
        ``x`` may be ``PartialSums``: the slices are added first (by the add-norm kernel where it is the one to run)."""
        if isinstance(x, PartialSums):
            fused = residual is not None and not fp8_out and column_scales is None
            if fused and _use_triton(self.use_triton, x.slices):
                return _fused_ops().fused_add_rms_norm(x.slices, residual, self.weight, self.eps)
            x = x.total()
        if _use_triton(self.use_triton, x):
            if fp8_out and x.dim() == 2:
                from engine.models.fp8 import Fp8Activation

                values, scales, residual = _fused_ops().rms_norm_fp8(x, self.weight, self.eps, residual,
                                                                     column_scales)
                out = Fp8Activation(values, scales, x.shape[0], x.dtype)
                return out if residual is None else (out, residual)
            return self._forward_triton(x, residual, column_scales)
        if column_scales is not None:
            x = (x.float() * column_scales).to(x.dtype)
        if residual is not None:
            # Add in the model dtype, as Hugging Face does, so the stored residual is exactly theirs.
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before scaling by the weight: the same rounding order as Hugging Face.
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)

    def _forward_triton(self, x: torch.Tensor, residual: torch.Tensor | None, column_scales: torch.Tensor | None):
        rows = x.reshape(-1, x.shape[-1])  # the kernels take [num_tokens, hidden]; a view for 2-D input
        if residual is None:
            if column_scales is not None:
                raise ValueError("RMSNorm: column_scales come with a residual (the add they are fused into)")
            return _fused_ops().rms_norm(rows, self.weight, self.eps).view(x.shape)
        out, residual = _fused_ops().fused_add_rms_norm(rows, residual.reshape(rows.shape), self.weight, self.eps,
                                                        column_scales)
        return out.view(x.shape), residual.view(x.shape)


class SiluAndMul(nn.Module):
    """SwiGLU activation on a fused [gate | up] projection."""

    def __init__(self):
        super().__init__()
        self.use_triton: bool | None = None  # see the module docstring

    def forward(self, x: torch.Tensor, fp8_out: bool = False,
                column_scales: torch.Tensor | None = None) -> torch.Tensor:  # x: [num_tokens, 2 * intermediate]
        """``fp8_out`` as in ``RMSNorm.forward``. ``column_scales`` (float32, [2 * intermediate]): scales that
        ``x``'s columns still need (``Fp8Weights.matmul_deferring_scales``), each product rounded to ``x``'s
        dtype before the activation, as if they had been applied to ``x`` first. ``x`` may be ``PartialSums``
        (gate|up cut along K, ``DecodeKSplit``): the kernel adds the slices as it reads them, the torch path first."""
        if isinstance(x, PartialSums):
            if _use_triton(self.use_triton, x.slices):
                x = x.slices  # [num_slices, num_tokens, 2 * intermediate]: the kernel adds them up
            else:
                x = x.total()
        if _use_triton(self.use_triton, x):
            if fp8_out:
                from engine.models.fp8 import Fp8Activation

                values, scales = _fused_ops().silu_and_mul_fp8(x, column_scales)
                return Fp8Activation(values, scales, x.shape[-2], x.dtype)
            return _fused_ops().silu_and_mul(x, column_scales=column_scales)
        if column_scales is not None:
            x = (x.float() * column_scales).to(x.dtype)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up  # [num_tokens, intermediate]


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
        self.use_triton: bool | None = None  # see the module docstring

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope on its own: the models hand it to attention instead (``pending``), whose Triton path applies it in
        the KV-cache write; this is the path of ``PendingRope.apply`` (the torch attention backend)."""
        if _use_triton(self.use_triton, q):
            if q_norm is None:
                return _fused_ops().rotary(positions, q, k, self.cos_sin_cache, self.mrope_section)
            # Both norms are built from the same config eps (LlamaAttention), so one eps serves both.
            return _fused_ops().qk_norm_rotary(
                positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, self.cos_sin_cache, self.mrope_section
            )
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        if self.mrope_section is None:
            cos_sin = self.cos_sin_cache[positions]  # [num_tokens, head_dim]
        else:  # column j of token t: the table's row positions[mrope_rows[j], t]
            cos_sin = self.cos_sin_cache.gather(0, positions[self.mrope_rows].T)
        # The table stays float32; cos/sin are rounded to the activation dtype as Hugging Face does.
        cos, sin = cos_sin.to(q.dtype).chunk(2, dim=-1)  # [num_tokens, head_dim // 2] each
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


@dataclass(frozen=True)
class PendingRope:
    """What one attention layer's q and k still need after the q|k|v projection: rope (``rotary``), after Qwen3's
    per-head RMSNorms where ``q_norm``/``k_norm`` are given; and, for one step, the tokens' ``positions``, the
    ``column_scales`` (float32 [q_size + 2 * kv_size]) the FP8 product has not applied to q|k|v's columns yet
    (``Fp8Weights.matmul_deferring_scales``), which come first, and before them the ``partials`` of a product cut
    along K (``DecodeKSplit``; [num_slices, num_tokens, q_size + 2 * kv_size]), whose sum q|k|v is: the q, k and v
    handed over with it are then views of the first slice.

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

    def apply(self, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) [num_tokens, heads, head_dim] added up from the partial products, with the column scales applied
        (each product rounded to the model dtype, as ``fp8_kernels.scale_columns_`` rounds it), then q and k normed
        and roped (``RotaryEmbedding``)."""
        if self.partials is not None:
            whole = PartialSums(self.partials).total()
            q, k, v = (part.view(x.shape) for x, part in
                       zip((q, k, v), whole.split([x.shape[1] * x.shape[2] for x in (q, k, v)], dim=-1)))
        if self.column_scales is not None:
            widths = [x.shape[1] * x.shape[2] for x in (q, k, v)]
            q, k, v = ((x.float() * s.view(x.shape[1:])).to(x.dtype)
                       for x, s in zip((q, k, v), self.column_scales.split(widths)))
        q, k = self.rotary(self.positions, q, k, self.q_norm, self.k_norm)
        return q, k, v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, heads, head_dim // 2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@contextlib.contextmanager
def without_transformers_init():
    """Build transformers modules (a vision-language model's vision tower) without their random initialisation:
    every weight is loaded after."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def set_use_triton(model: nn.Module, enabled: bool | None) -> None:
    """Set ``use_triton`` on every norm, activation and rotary module of ``model`` (None: by device)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
            module.use_triton = enabled


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


class Fp8Weights:
    """What FusedLinear and RowParallelLinear share: an optional FP8 weight (``engine.models.fp8``).

    ``set_fp8_weight`` swaps the weight for float8_e4m3 values plus ``weight_scale_inv``, the float32
    scales that multiply them back (one per output row, or one per ``fp8_block`` tile as FP8 checkpoints
    store them); ``matmul`` then runs the FP8 product. Without it the layer is a plain linear.
    """

    fp8_block: tuple[int, int] | None = None

    def set_fp8_weight(self, weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None) -> None:
        source_range = getattr(self.weight, "source_range", None)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        self.fp8_block = block
        self.__dict__.pop("_cpu_widened", None)
        self.__dict__.pop("_cublas_scales", None)
        if source_range is not None:  # the checkpoint columns of a row-parallel rank, in elements and in tiles
            self.weight.source_range = source_range
            dim, start, length = source_range
            if block is not None:
                self.weight_scale_inv.source_range = (dim, start // block[1], -(-length // block[1]))

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == torch.float8_e4m3fn

    @property
    def takes_fp8_input(self) -> bool:
        """Whether ``forward`` takes an ``Fp8Activation`` (its input quantized by the kernel that computed it): an
        FP8 weight on a GPU whose product runs through cuBLAS's block scaling. It takes plain tensors too."""
        return self.is_fp8 and self.weight.is_cuda and self._kept("_cublas_scales") is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.is_fp8:
            from engine.models.fp8 import fp8_linear

            if self.weight.device.type == "cpu":
                return fp8_linear(x, self.weight, self.weight_scale_inv, bias, self.fp8_block,
                                  widened=self._kept("_cpu_widened"))
            return fp8_linear(x, self.weight, self.weight_scale_inv, bias, self.fp8_block,
                              cublas_scales=self._kept("_cublas_scales"))
        return F.linear(x, self.weight, bias)

    def matmul_deferring_scales(self, x) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where ``takes_fp8_input``: ``fp8.fp8_linear_deferring_scales`` on this weight (no bias), the product
        and the scales its columns still need, for a consumer that applies them as it reads the product."""
        from engine.models.fp8 import fp8_linear_deferring_scales

        if self.bias is not None:
            raise ValueError("matmul_deferring_scales: a layer with a bias adds it after the scales")
        return fp8_linear_deferring_scales(x, self.weight, self._kept("_cublas_scales"))

    def _kept(self, name: str) -> torch.Tensor | None:
        """An operand derived from the FP8 weight once and kept until the weight changes: on the CPU, which has
        no FP8 arithmetic, the weight widened to float32 (the rounding stays FP8's; the memory saving does not
        apply there); on a GPU, the scales in cuBLAS's block-scaling layout (None where it has none)."""
        from engine.models.fp8 import cublas_weight_scales, widen_weight

        weight, scales = self.weight, self.weight_scale_inv
        key = (id(weight), weight._version, id(scales), scales._version)  # reloaded or swapped: derive again
        kept = self.__dict__.get(name)
        if kept is None or kept[0] != key:
            derive = widen_weight if name == "_cpu_widened" else cublas_weight_scales
            kept = self.__dict__[name] = (key, derive(weight, scales, self.fp8_block))
        return kept[1]


class FusedLinear(DecodeKSplit, Fp8Weights, nn.Linear):
    """One matmul for several projections of the same input, e.g. q|k|v or gate|up.

    The output rows are the shards in order. Checkpoints store each shard as its own
    tensor (``q_proj``, ``k_proj``, ...); ``load_shard`` copies one into its row range.
    With tensor parallelism each rank holds some rows of every shard (a column-parallel
    linear): ``source_rows`` gives, per shard, the (first row, count) of the checkpoint
    tensor this rank loads. ``k_split``: the product's name in ``MINIVLLM_DECODE_KSPLIT``
    (``decode_k_slices``), where the layer that reads it adds partial products.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool,
                 source_rows: dict[str, tuple[int, int]] | None = None, k_split: str | None = None):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.read_k_split(k_split, in_features)
        self.shard_slices: dict[str, slice] = {}
        self.source_rows = source_rows or {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_slices[name] = slice(offset, offset + size)
            offset += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def load_shard(self, param: nn.Parameter, shard: str, loaded) -> None:
        rows, dst = self.source_rows.get(shard), self.shard_slices[shard]
        if param is getattr(self, "weight_scale_inv", None) and self.fp8_block is not None:
            tile = self.fp8_block[0]  # block scales: one row of scales per ``tile`` rows of the weight
            dst = slice(dst.start // tile, -(-dst.stop // tile))
            rows = rows and (rows[0] // tile, -(-rows[1] // tile))
        copy_weight(param.data[dst], take(loaded, 0, rows), f"{shard} shard")


class RowParallelLinear(DecodeKSplit, Fp8Weights, nn.Linear):
    """A linear whose input features are split over the tensor-parallel ranks (o_proj, down_proj): each
    rank multiplies its slice, one all-reduce sums them, the bias is added once after it. ``k_split`` as in
    ``FusedLinear``: ``forward_deferring_scales`` may return partial products (one rank only)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, k_split: str | None = None):
        start, local = shard_range(in_features)
        super().__init__(local, out_features, bias=bias)
        self.weight.source_range = (1, start, local)  # checkpoint columns this rank loads
        # With several ranks the partial products are all-reduced whole (forward_deferring_scales): never cut.
        self.read_k_split(k_split if tp_size() == 1 else None, local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self.matmul(x, self.bias)
        out = all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias

    def forward_deferring_scales(self, x) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``, with the per-channel weight scales left to the caller where the FP8 product leaves them
        (``matmul_deferring_scales``: prefill-sized batches): (out, float32 column scales or None). One rank only:
        with tensor parallelism the ranks' partial products are summed first. (Quantized at load time, the ranks
        share their channel scales, ``fp8.quantize_model_weights``, so the sum could take them after; that path is
        not measured on several GPUs yet. A checkpoint's 128 x 128 tiles differ by rank and cannot.) With ``k_slices``
        > 1 (``MINIVLLM_DECODE_KSPLIT``), a 16-bit weight's product of a decode-sized batch comes back as
        ``PartialSums``, for the residual add-norm that reads it next to add up."""
        if tp_size() == 1 and self.bias is None and self.takes_fp8_input:
            return self.matmul_deferring_scales(x)
        if tp_size() == 1 and self.splits_along_k(x):
            return self.partial_products(x), None
        return self.forward(x), None


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows split over the ranks by token id; a token's row comes from the rank holding it, the
    others contribute zeros, and an all-reduce puts it together."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        self.vocab_start, local = shard_range(num_embeddings)
        super().__init__(local, embedding_dim)
        self.weight.source_range = (0, self.vocab_start, local)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(nn.Linear):
    """The output projection with its vocabulary rows split over the ranks (the same split as the
    embedding, so tied weights are the same tensor); the logit slices are gathered in rank order."""

    def __init__(self, hidden_size: int, vocab_size: int):
        start, local = shard_range(vocab_size)
        super().__init__(hidden_size, local, bias=False)
        self.weight.source_range = (0, start, local)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(F.linear(hidden, self.weight))


def take(tensor, dim: int, span: tuple[int, int] | None) -> torch.Tensor:
    """``tensor`` (a torch tensor or a lazily read checkpoint tensor) narrowed to ``span`` = (start, length)
    along ``dim``; only that part is read from the checkpoint."""
    if span is None:
        return tensor if isinstance(tensor, torch.Tensor) else tensor.load()
    return tensor.narrow(dim, *span)


@torch.no_grad()
def copy_weight(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into a parameter (any device/dtype), insisting on the exact shape."""
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch for {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)


@dataclass
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, or one shard of a fused parameter."""

    param: nn.Parameter | None
    fused: FusedLinear | None = None
    shard: str | None = None
    loader: Any = None  # a module's own loader for the tensor (``weight_targets``): loader(name, tensor)

    def load(self, name: str, tensor) -> None:
        if self.loader is not None:
            self.loader(name, tensor)
            return
        if self.fused is not None:
            self.fused.load_shard(self.param, self.shard, tensor)
            return
        sharded = getattr(self.param, "source_range", None)  # (dim, start, length) under tensor parallelism
        dim, span = (sharded[0], sharded[1:]) if sharded is not None and tp_size() > 1 else (0, None)
        copy_weight(self.param.data, take(tensor, dim, span), name)


def checkpoint_targets(model: nn.Module) -> dict[str, WeightTarget]:
    """Map each Hugging Face tensor name the model needs to the parameter it fills.

    Parameter names mirror Hugging Face's, except that a fused linear ``x.qkv_proj.weight``
    is filled from ``x.q_proj.weight``, ``x.k_proj.weight`` and ``x.v_proj.weight``.
    Tied parameters appear once, under their first name.
    """
    targets: dict[str, WeightTarget] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if hasattr(module, "weight_targets"):  # a module that lays several checkpoint tensors out its own way
            for name, loader in module.weight_targets(module_name).items():
                targets[name] = WeightTarget(None, loader=loader)
            seen.update(id(p) for p in module.parameters(recurse=False))
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, FusedLinear):
                parent = module_name.rpartition(".")[0]
                for shard in module.shard_slices:
                    hf_name = f"{parent}.{shard}.{param_name}" if parent else f"{shard}.{param_name}"
                    targets[hf_name] = WeightTarget(param, module, shard)
            else:
                targets[f"{module_name}.{param_name}" if module_name else param_name] = WeightTarget(param)
    return targets


def load_checkpoint_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], skip: set[str] | None = None
) -> set[str]:
    """Copy Hugging Face-named tensors into ``model``; return the names loaded.

    Names in ``skip`` and rotary ``inv_freq`` buffers are ignored. An unknown name, or
    a needed tensor that never arrives, raises ValueError naming it.
    """
    targets = checkpoint_targets(model)
    skip = skip or set()
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in skip or name.endswith("rotary_emb.inv_freq"):
            continue
        target = targets.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        target.load(name, tensor)
        loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for {type(model).__name__}: {shown}")
    return loaded
