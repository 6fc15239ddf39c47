"""RMSNorm, optionally fused with the residual add and written as an FP8 linear's input: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.fused.checks import _check_activation, _check_column_scales, _check_weight, _fp8_output
from engine.ops.intmath import next_power_of_2
from engine.ops.triton_helpers import round_to, store_fp8_groups

MAX_HIDDEN_SIZE = 16384  # one row per program, held in registers


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, col_scale_ptr, weight_ptr, out_ptr, residual_out_ptr, q_ptr, s_ptr,
    eps, num_rows, hidden_size, stride_xs, stride_x, stride_r, stride_o, stride_ro, stride_q, stride_s, stride_sg,
    HAS_RESIDUAL: tl.constexpr, COL_SCALES: tl.constexpr, FP8_GROUP: tl.constexpr, BLOCK: tl.constexpr,
    NUM_SLICES: tl.constexpr,
):
    """One row, as a [BLOCK / 128, 128] tile (or [1, BLOCK]). ``FP8_GROUP`` (0 or 128) > 0: the normed row goes out
    as float8 values and a scale per 128 columns (one row of the tile each; ``q_ptr``, ``s_ptr``), not to
    ``out_ptr`` (which then only gives the model dtype); rows from ``num_rows`` on are padding, zeros. The tile is
    the same either way, so that both sum the squares in the same order and round alike. ``COL_SCALES``: ``x``
    times its columns' scales first, rounded to the model dtype (``fp8_kernels.scale_columns_``'s result).
    ``NUM_SLICES`` > 1: ``x`` is that many partial products ``stride_xs`` apart, added in float32 and rounded once, as
    the whole product would have been (``LinearOutput``)."""
    COLS: tl.constexpr = 128 if BLOCK >= 128 else BLOCK
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    in_row = offs < hidden_size
    mask = in_row & (row < num_rows) if FP8_GROUP > 0 else in_row
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM_SLICES > 1:
        for i in tl.static_range(1, NUM_SLICES):
            x += tl.load(x_ptr + i * stride_xs + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x, out_ptr)
    if COL_SCALES:
        x = round_to(x * tl.load(col_scale_ptr + offs, mask=in_row, other=0.0), out_ptr)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, out_ptr)  # the residual stream is kept in the model dtype
        tl.store(residual_out_ptr + row * stride_ro + offs, x.to(residual_out_ptr.dtype.element_ty), mask=mask)
    rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / hidden_size + eps)
    w = tl.load(weight_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
    out = w * round_to(x * rstd, out_ptr)  # cast back before the weight, like Hugging Face
    if FP8_GROUP > 0:
        store_fp8_groups(round_to(out, out_ptr), offs, in_row, q_ptr + row * stride_q, s_ptr + row * stride_s,
                         stride_sg, 0, tl.cdiv(hidden_size, FP8_GROUP))
    else:
        tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _norm_launch(hidden_size: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the whole row in one tile, about 8 to 32 elements per thread."""
    block = next_power_of_2(hidden_size)
    return block, min(max(block // 256, 1), 16)


def _rms_norm(name: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              fp8: bool = False, column_scales: torch.Tensor | None = None):
    slices = x  # [num_slices, tokens, hidden]: partial products to add first (fused_add_rms_norm only)
    if x.dim() == 3 and residual is not None and not fp8 and column_scales is None:
        _check_activation(name, "x", x, 3)
        if not 1 <= x.shape[0] <= 16:
            raise ValueError(f"{name}: 1 to 16 partial products, got {x.shape[0]}")
        x = x[0]
    else:
        _check_activation(name, "x", x, 2)
    num_tokens, hidden_size = x.shape
    if not 0 < hidden_size <= MAX_HIDDEN_SIZE:
        raise ValueError(f"{name}: hidden size {hidden_size} is outside (0, {MAX_HIDDEN_SIZE}]")
    _check_weight(name, "weight", weight, hidden_size, x)
    if residual is not None:
        _check_activation(name, "residual", residual, 2)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"{name}: residual must match x ({tuple(x.shape)} {x.dtype} on {x.device}), "
                             f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if column_scales is not None:
        _check_column_scales(name, column_scales, hidden_size, x)
    if fp8:
        values, scales, group = _fp8_output(name, x, hidden_size)
        assert group == 128, "the kernel's tile rows are its FP8 groups"
        out, rows = x, values.shape[0]  # out: only its dtype is read
    else:
        out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
        values = scales = out  # unused
        rows, group = num_tokens, 0
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if num_tokens > 0:
        block, num_warps = _norm_launch(hidden_size)
        res_in = residual if residual is not None else x  # unused without HAS_RESIDUAL
        res_out = new_residual if new_residual is not None else out
        num_slices = slices.shape[0] if slices.dim() == 3 else 1
        _rms_norm_kernel[(rows,)](
            x, res_in, column_scales if column_scales is not None else weight, weight, out, res_out, values, scales,
            float(eps), num_tokens, hidden_size,
            slices.stride(0) if num_slices > 1 else 0, x.stride(0), res_in.stride(0),
            out.stride(0), res_out.stride(0), values.stride(0), scales.stride(0), scales.stride(1),
            HAS_RESIDUAL=residual is not None, COL_SCALES=column_scales is not None,
            FP8_GROUP=group, BLOCK=block, num_warps=num_warps, enable_fp_fusion=False, NUM_SLICES=num_slices,
        )
    return ((values, scales) if fp8 else out), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [num_tokens, hidden] (any row stride): a new [num_tokens, hidden] tensor."""
    out, _ = _rms_norm("rms_norm", x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    column_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum rounded to the model dtype; inputs are not written.
    ``column_scales`` (float32 [hidden]): scales ``x``'s columns still need (``Fp8LinearMethod.apply_deferred``),
    each product rounded to the model dtype before the add, as if ``x`` had been multiplied by them first.
    ``x`` may be [num_slices, num_tokens, hidden] (no ``column_scales`` then): partial products of K's slices whose sum
    is the input, added in float32 and rounded to the model dtype once (``LinearOutput``)."""
    return _rms_norm("fused_add_rms_norm", x, residual, weight, eps, column_scales=column_scales)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    column_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``rms_norm`` (``fused_add_rms_norm`` with a ``residual`` and maybe ``column_scales``) written straight as the
    input of an FP8 linear:
    ``(values, scales, x + residual or None)``, the normed rows rounded to the model dtype and then quantized as
    ``fp8_kernels.quantize_rows(normed, 128, cublas_layout=True)`` quantizes them (rows padded to a multiple of 4
    with zeros, scales a token-major transposed view). The compiler may order the sum of squares differently from
    ``rms_norm``'s, so a normed value can round the other way now and then. The hidden size must be a multiple of
    128."""
    (values, scales), new_residual = _rms_norm("rms_norm_fp8", x, residual, weight, eps, fp8=True,
                                               column_scales=column_scales)
    return values, scales, new_residual
