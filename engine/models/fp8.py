"""The FP8 arithmetic of the linear layers: float8_e4m3 weights with float32 scales, activations quantized at run
time.

Two weight layouts, both kept in FP8 in memory (half the bytes of bfloat16):

* **per output channel** (``--quantization fp8``): a bfloat16/float16 checkpoint is quantized at load
  time, one scale per row of ``W`` (its absolute maximum over 448);
* **blocks** (FP8 checkpoints in Hugging Face's format, ``quantization_config.quant_method == "fp8"``
  with ``weight_block_size: [128, 128]``, as in the Qwen3 FP8 releases): one scale per 128 x 128 tile
  of ``W``, read from the checkpoint's ``weight_scale_inv`` as stored.

The product: each token's activation row is quantized on the fly with one scale per 128 columns (finer
than one per row: on the default model +2.7% perplexity against +3.7%), the FP8 operands are multiplied
with float32 accumulation, and the scales are applied to the result. On a GPU with FP8 tensor cores
(compute capability 8.9+) both layouts run through cuBLAS's block-scaled ``torch._scaled_mm`` where torch
and the GPU have it (Hopper, CUDA 12.9+; 1.1-1.9x faster than bf16 at decode batch sizes on Llama-3.1-8B's
projections, see bench/RESULTS.md), else through a Triton kernel (``fp8_kernels.scaled_matmul``) with the
same arithmetic. cuBLAS runs other kernels for 1 x 128 weight scales (one per row and 128 columns) and for
128 x 128 tiles, and the tiles' are the faster ones from 160-256 tokens on; ``CublasScales`` keeps both
layouts of a weight and the product picks by its token count. Per-channel weights go through the tile kernels
as tiles of ones, their channels' scales then multiplying the product's columns (``scale_columns_``).
Where a layer's input comes from an RMSNorm or SwiGLU kernel (``engine.models.llama``), that kernel writes it
already quantized (``Fp8Activation``, ``fused_ops.rms_norm_fp8``), and SwiGLU applies gate|up's channel scales
as it reads the product (``fp8_linear_deferring_scales``): fewer launches and passes over the activations.
Elsewhere (the CPU) the same arithmetic runs as dequantize-then-matmul: activations are
rounded through FP8 exactly as the GPU path rounds them, so CPU accuracy tests measure what the GPU
computes. The CPU layers widen their FP8 values to float32 once and keep them (``Fp8LinearMethod``): CPUs
have no FP8 arithmetic to save memory with. The layers' side of it (which parameters, when they are quantized,
what the kernels around a product may take over) is ``engine.models.linear.fp8``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.paged_cache import fp8_to_float32, quantize_fp8

ACTIVATION_GROUP = 128  # activation columns that share one scale (and block weights' tile width)


@dataclass(frozen=True)
class Fp8Scheme:
    """How one checkpoint's linear layers are quantized: ``block`` = (rows, cols) of a weight scale's tile, or
    None for one scale per output channel."""

    block: tuple[int, int] | None = None
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, quantization_config: dict) -> Fp8Scheme:
        """From a checkpoint's ``quantization_config``; ValueError for what is not implemented."""
        method = quantization_config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported (only 'fp8')")
        scheme = quantization_config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"FP8 activation_scheme {scheme!r} is not supported (only 'dynamic')")
        fmt = quantization_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 format {fmt!r} is not supported (only 'e4m3')")
        block = quantization_config.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or any(int(b) < 1 for b in block):
                raise ValueError(f"weight_block_size must be two positive ints, got {block!r}")
            block = (int(block[0]), int(block[1]))
            if block[1] != ACTIVATION_GROUP or block[0] % 16:
                raise ValueError(f"weight_block_size {list(block)} is not supported (the columns of a block must "
                                 f"be {ACTIVATION_GROUP}, its rows a multiple of 16)")
        skip = tuple(quantization_config.get("modules_to_not_convert") or ())
        return cls(block, skip)


# ------------------------------------------------------------------------------------------ quantizers


def quantize_per_channel(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (float8 W, float32 scales [out]) with ``W ~= W8 * scales[:, None]``; ``amax``: each channel's
    absolute maximum where W holds only some of its columns (``quantize_fp8``)."""
    return quantize_fp8(weight, amax)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [m, k] -> (float8 [m, k], float32 scales [m, 1] or, with ``group``, [m, ceil(k / group)]):
    each row (or each ``group`` columns of it) scaled so that its absolute maximum maps to 448."""
    if group is None:
        values, scales = quantize_fp8(x)
        return values, scales[:, None]
    m, k = x.shape
    groups = -(-k // group)
    values, scales = quantize_fp8(F.pad(x.float(), (0, groups * group - k)).view(m, groups, group))
    values = values.view(m, groups * group)[:, :k]
    return values, scales


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """The FP8 weight in ``dtype``: per-channel scales [out] or block scales [ceil(out/bn), ceil(in/bk)]."""
    w32 = fp8_to_float32(weight)
    if block is None:
        return (w32 * scale[:, None]).to(dtype)
    bn, bk = block
    full = scale.repeat_interleave(bn, 0)[: w32.shape[0]].repeat_interleave(bk, 1)[:, : w32.shape[1]]
    return (w32 * full).to(dtype)


# ------------------------------------------------------------------------------------------ the product


@functools.lru_cache(maxsize=None)
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def fp8_gemm_available(device: torch.device) -> bool:
    """True where the FP8 operands are multiplied natively (CUDA, compute capability 8.9 or newer)."""
    if device.type != "cuda":
        return False
    return _has_fp8_tensor_cores(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class Fp8Activation:
    """A linear layer's input already quantized, by the kernel that computed it (``fused_ops.rms_norm_fp8``,
    ``silu_and_mul_fp8``), in the layout cuBLAS's block-scaled product takes: float8 ``values`` [rows padded to
    a multiple of 4, k], float32 ``scales`` one per token and 128 columns (a token-major transposed view), the
    ``num_rows`` real tokens, and the compute ``dtype`` the product returns. Only layers whose product runs
    through cuBLAS's block scaling take one (``LinearBase.takes_fp8_input``)."""

    values: torch.Tensor
    scales: torch.Tensor
    num_rows: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_rows, self.values.shape[1]))


def fp8_linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               block: tuple[int, int] | None = None, widened: torch.Tensor | None = None,
               cublas_scales: CublasScales | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for an FP8 ``weight`` [out, in] with its scales; ``x`` [..., in] in the compute dtype.

    ``widened`` is ``widen_weight``'s result for this weight, kept by the caller so that the reference path
    does not convert the FP8 values again on every call; ``cublas_scales`` likewise ``cublas_weight_scales``'s,
    on GPUs where cuBLAS takes them, which an ``Fp8Activation`` input needs."""
    if isinstance(x, Fp8Activation):
        out = _cublas_fp8_linear(x, weight, cublas_scales)
        return out if bias is None else out + bias
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if fp8_gemm_available(x.device) and rows.shape[0] > 0:
        out = _gpu_fp8_linear(rows, weight, scale, block, cublas_scales)
    else:
        out = _reference_fp8_linear(rows, weight, scale, block, widened)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], weight.shape[0])


def fp8_linear_deferring_scales(x: torch.Tensor | Fp8Activation, weight: torch.Tensor,
                                cublas_scales: CublasScales) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fp8_linear`` without a bias through cuBLAS, the per-channel weight scales left to the caller where the
    product runs on 128 x 128 tiles of ones (from ``block_scales_min_rows`` tokens on): (the product in the
    compute dtype, [rows, out], and the float32 scales of its columns or None). ``out * scales`` rounded once to
    the compute dtype is what ``fp8_linear`` returns; a kernel that reads the product anyway (SwiGLU after
    gate|up) applies them on the way and saves a pass over it."""
    from engine.ops import fp8 as fp8_kernels

    if cublas_scales is None:
        raise ValueError("fp8_linear: the cuBLAS product needs the weight's cuBLAS scales")
    if isinstance(x, Fp8Activation):
        return _cublas_product(x.values, x.scales, x.num_rows, weight, cublas_scales, x.dtype)
    xq, x_scales = fp8_kernels.quantize_rows(x, ACTIVATION_GROUP, cublas_layout=True)
    return _cublas_product(xq, x_scales, x.shape[0], weight, cublas_scales, x.dtype)


def widen_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 operand the reference product multiplies: the FP8 values (per-channel scales are applied to
    the product) or, with block scales, the dequantized weight. Exact: every float8_e4m3 value is a float32."""
    return fp8_to_float32(weight) if block is None else dequantize_weight(weight, scale, block, torch.float32)


def _reference_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int] | None, widened: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize-then-matmul, with the activations rounded through FP8 as the GPU path rounds them: the FP8
    values times their group scales multiplied in float32, per-channel weight scales applied to the product."""
    values, x_scales = quantize_rows(x, ACTIVATION_GROUP)
    w = widened if widened is not None else widen_weight(weight, scale, block)
    xq = fp8_to_float32(values) * x_scales.repeat_interleave(ACTIVATION_GROUP, 1)[:, : x.shape[1]]
    out = F.linear(xq, w)
    return (out if block is not None else out * scale).to(x.dtype)


def _gpu_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None, cublas_scales: CublasScales | None = None) -> torch.Tensor:
    from engine.ops import fp8 as fp8_kernels

    if cublas_scales is not None:
        return _cublas_fp8_linear(x, weight, cublas_scales)
    xq, x_scales = fp8_kernels.quantize_rows(x, ACTIVATION_GROUP)
    return fp8_kernels.scaled_matmul(xq, x_scales, weight, scale, block, x.dtype)


def _cublas_fp8_linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor,
                       cublas_scales: CublasScales) -> torch.Tensor:
    """``fp8_linear_deferring_scales`` with the column scales it leaves applied: the product, no bias."""
    from engine.ops import fp8 as fp8_kernels

    out, column_scales = fp8_linear_deferring_scales(x, weight, cublas_scales)
    return out if column_scales is None else fp8_kernels.scale_columns_(out, column_scales)


def _cublas_product(xq: torch.Tensor, x_scales: torch.Tensor, num_rows: int, weight: torch.Tensor,
                    cublas_scales: CublasScales, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """cuBLAS's block-scaled product of quantized activations (rows padded to a multiple of 4) and an FP8 weight:
    ([num_rows, out] in ``dtype``, the scales its columns still need or None)."""
    weight_scales, column_scales = cublas_scales.for_rows(num_rows)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scales, scale_b=weight_scales, out_dtype=dtype)[:num_rows]
    return out, column_scales


# From this many tokens on, weights multiply with cuBLAS's 128 x 128 weight scaling; below it, with 1 x 128 scaling
# (one scale per row and 128 columns). The same product, but cuBLAS runs other kernels for the two. On an H200, with
# Llama-3.1-8B's projections (bench/fp8_gemm.py, bench/RESULTS.md): 1 x 128 is the faster one at 151 tokens; from
# 256 tokens on, 128 x 128 is, even with per-channel scales applied to the output afterwards (at 16,384 tokens
# 1.46-1.74x bf16 against 1.16-1.32x). Wide products cross over sooner (``block_scales_min_rows``).
BLOCK_SCALES_MIN_ROWS = 256


def block_scales_min_rows(out_features: int) -> int:
    """The token count from which a weight with this many output rows multiplies on cuBLAS's 128 x 128 kernels.
    Measured on an H200 at 144-256 tokens (bench/RESULTS.md): gate|up's 28,672 rows were faster on the tiles from
    160 tokens on (their channel scales applied by SwiGLU; 59.9 against 72.2 us at 192), q|k|v's 6,144 rows from
    224 (20.9 against 26.8 us, scales included), o's and down's 4,096 rows not before 256."""
    if out_features >= 16384:
        return 160
    if out_features >= 6144:
        return 224
    return BLOCK_SCALES_MIN_ROWS


@dataclass(frozen=True)
class CublasScales:
    """A weight's scales in the layouts cuBLAS's block-scaled ``torch._scaled_mm`` takes; all describe the same
    weight exactly.

    ``groups``: one scale per output row and 128 columns, [groups, out] contiguous (per-channel scales repeated
    over the groups, block scales over their tile's rows). ``tiles``: one per 128 x 128 tile, as the transposed
    view cuBLAS takes. Per-channel scales vary within a tile, so for them the tiles are ones and ``rows`` holds
    the scales that then multiply the product's columns."""

    groups: torch.Tensor
    tiles: torch.Tensor | None
    rows: torch.Tensor | None = None

    @classmethod
    def of(cls, scale: torch.Tensor, block: tuple[int, int] | None, num_groups: int) -> CublasScales:
        """From per-channel scales [out] (``block`` None) or 128 x 128 block scales [out / 128, groups]."""
        if block is not None:
            return cls(scale.repeat_interleave(block[0], 0).t().contiguous(), scale.t())
        n = scale.shape[0]
        groups = scale[None, :].expand(num_groups, n).contiguous()
        if n % 128:
            return cls(groups, None)
        return cls(groups, torch.ones(n // 128, num_groups, device=scale.device).t(), scale)

    @property
    def min_rows(self) -> int:
        """Tokens from which the tiles serve, by the weight's width (``block_scales_min_rows``)."""
        return block_scales_min_rows(self.groups.shape[1])

    def for_rows(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight scales, the output columns' scales or None) for the faster of cuBLAS's kernels at
        ``num_rows`` tokens."""
        if self.tiles is not None and num_rows >= self.min_rows:
            return self.tiles, self.rows
        return self.groups, None


def cublas_weight_scales(weight: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int] | None) -> CublasScales | None:
    """The weight's scales as cuBLAS's block scaling takes them, or None where that product is not available:
    no Hopper GPU, a torch or cuBLAS without block scaling, or shapes it does not take."""
    if weight.device.type != "cuda" or not _cublas_block_scaling(weight.device):
        return None
    n, k = weight.shape
    groups = k // ACTIVATION_GROUP
    if k % ACTIVATION_GROUP or groups % 4 or n % 16:
        return None
    if block is not None and (block != (128, 128) or n % 128):  # cuBLAS's weight blocks are 128 x 128
        return None
    return CublasScales.of(scale, block, groups)


@functools.lru_cache(maxsize=None)
def _cublas_block_scaling(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` multiplies with 1 x 128 activation and 128 x 128 / 1 x 128 weight scales here
    (Hopper, CUDA 12.9+, a torch that knows block scaling), checked once on a small product."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        from engine.ops import fp8 as fp8_kernels

        x = torch.randn(8, 512, device=device)
        w = torch.randn(256, 512, device=device)
        values, scales = quantize_per_channel(w)
        xq, xs = fp8_kernels.quantize_rows(x, ACTIVATION_GROUP, cublas_layout=True)
        got = torch._scaled_mm(xq, values.t(), scale_a=xs, scale_b=scales[None, :].expand(4, 256).contiguous(),
                               out_dtype=torch.float32)
        want = _reference_fp8_linear(x, values, scales, None)
        return bool(((got - want).norm() / want.norm()) < 1e-3)
    except (RuntimeError, TypeError, ValueError):
        return False


def blocks(size: int, block: int) -> int:
    return math.ceil(size / block)
