"""SwiGLU on a fused ``[gate | up]`` projection, optionally written as an FP8 linear's input."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.fused.checks import _check_activation, _check_column_scales, _fp8_output
from engine.ops.intmath import cdiv, next_power_of_2
from engine.ops.triton_helpers import round_to, store_fp8_groups

_SWIGLU_ROWS_FROM = 1024  # tokens from which the FP8 SwiGLU takes several rows a program


@triton.jit(do_not_specialize=["num_rows", "num_padded"])
def _silu_and_mul_kernel(x_ptr, col_scale_ptr, out_ptr, q_ptr, s_ptr, num_rows, num_padded, inter_size,
                         stride_xs, stride_x, stride_o, stride_q, stride_s, stride_sg,
                         COL_SCALES: tl.constexpr, FP8_GROUP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                         NUM_SLICES: tl.constexpr):
    """``BLOCK`` columns of ``ROWS`` rows, each as ``_rms_norm_kernel`` tiles a row; ``FP8_GROUP`` > 0 as there
    (rows from ``num_rows`` to ``num_padded`` are padding, zeros). ``COL_SCALES``: gate and up times their
    columns' scales first, each rounded to the model dtype, as ``fp8_kernels.scale_columns_`` would leave them;
    the scales are loaded once for all the program's rows. ``NUM_SLICES`` > 1: ``x`` is that many partial products
    of gate|up ``stride_xs`` apart, added in float32 and rounded once, as the whole product would have been
    (``LinearOutput``)."""
    COLS: tl.constexpr = FP8_GROUP if FP8_GROUP > 0 else BLOCK
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    in_row = offs < inter_size
    if COL_SCALES:
        gate_scales = tl.load(col_scale_ptr + offs, mask=in_row, other=0.0)
        up_scales = tl.load(col_scale_ptr + inter_size + offs, mask=in_row, other=0.0)
    for r in tl.static_range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + r
        mask = in_row & (row < num_rows)
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter_size + offs, mask=mask, other=0.0).to(tl.float32)
        if NUM_SLICES > 1:
            for i in tl.static_range(1, NUM_SLICES):
                gate += tl.load(x_ptr + i * stride_xs + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
                up += tl.load(x_ptr + i * stride_xs + row * stride_x + inter_size + offs, mask=mask,
                              other=0.0).to(tl.float32)
            gate = round_to(gate, out_ptr)
            up = round_to(up, out_ptr)
        if COL_SCALES:
            gate = round_to(gate * gate_scales, out_ptr)
            up = round_to(up * up_scales, out_ptr)
        act = round_to(gate / (1.0 + tl.exp(-gate)), out_ptr)  # F.silu, rounded to the model dtype
        if FP8_GROUP > 0:
            stored = row < num_padded
            store_fp8_groups(round_to(act * up, out_ptr), offs, in_row & stored, q_row_ptr=q_ptr + row * stride_q,
                             s_row_ptr=s_ptr + row * stride_s, stride_sg=stride_sg,
                             first_group=tl.program_id(1) * (BLOCK // FP8_GROUP),
                             num_groups=tl.where(stored, tl.cdiv(inter_size, FP8_GROUP), 0))
        else:
            tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, fp8: bool = False, column_scales: torch.Tensor | None = None):
    """SwiGLU of ``x`` [num_tokens, 2 * inter] (any row stride): ``silu(gate) * up``, [num_tokens, inter]
    (with ``fp8``, ``silu_and_mul_fp8``'s result). ``column_scales`` (float32 [2 * inter]): the SwiGLU of
    ``x`` times them, each product rounded to ``x``'s dtype, as ``fp8_kernels.scale_columns_`` would leave it.
    ``x`` may be [num_slices, num_tokens, 2 * inter], partial products of gate|up (``LinearOutput``): their
    sum, rounded once to ``x``'s dtype, is the input."""
    slices = x
    if x.dim() == 3:
        _check_activation("silu_and_mul", "x", x, 3)
        if not 1 <= x.shape[0] <= 16:
            raise ValueError(f"silu_and_mul: 1 to 16 partial products, got {x.shape[0]}")
        x = x[0]
    _check_activation("silu_and_mul", "x", x, 2)
    num_tokens, width = x.shape
    if width % 2 != 0:
        raise ValueError(f"silu_and_mul: the last dim must be even ([gate | up]), got {width}")
    if column_scales is not None:
        _check_column_scales("silu_and_mul", column_scales, width, x)
    inter_size = width // 2
    if fp8:
        values, scales, group = _fp8_output("silu_and_mul_fp8", x, inter_size)
        out, rows = x, values.shape[0]  # out: only its dtype is read
    else:
        out = torch.empty((num_tokens, inter_size), dtype=x.dtype, device=x.device)
        values = scales = out  # unused
        rows, group = num_tokens, 0
    if num_tokens > 0 and inter_size > 0:
        block = min(next_power_of_2(inter_size), 1024)
        # Prefill-sized FP8 outputs: 4 rows a program, faster on Llama-3.1-8B's width (bench/swiglu_fp8.py,
        # bench/RESULTS.md); decode batches keep one, for more programs.
        per_program = 4 if fp8 and num_tokens >= _SWIGLU_ROWS_FROM else 1
        _silu_and_mul_kernel[(cdiv(rows, per_program), cdiv(inter_size, block))](
            x, column_scales if column_scales is not None else x, out, values, scales,
            num_tokens, rows, inter_size, slices.stride(0) if slices.dim() == 3 else 0, x.stride(0), out.stride(0),
            values.stride(0), scales.stride(0), scales.stride(1),
            COL_SCALES=column_scales is not None, FP8_GROUP=group, BLOCK=block, ROWS=per_program, num_warps=4,
            enable_fp_fusion=False, NUM_SLICES=slices.shape[0] if slices.dim() == 3 else 1,
        )
    return (values, scales) if fp8 else out


def silu_and_mul_fp8(x: torch.Tensor, column_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul`` written straight as the input of an FP8 linear: ``(values, scales)`` as in
    ``rms_norm_fp8``. The intermediate size must be a multiple of 128."""
    return silu_and_mul(x, fp8=True, column_scales=column_scales)
