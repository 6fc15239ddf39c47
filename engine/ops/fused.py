"""Fused Triton kernels for the small ops of a decoder layer, each with a wrapper that checks its inputs.

Eagerly, a decoder layer spends most of its kernel launches on tiny elementwise ops: RMSNorm
alone is half a dozen (cast, square, mean, rsqrt, scale, cast back, weight), rotary embedding
a dozen more. Each costs a few microseconds even when replayed from a CUDA graph. Here each
group is one kernel:

* ``rms_norm`` / ``fused_add_rms_norm``: one program per row, the whole row in registers.
* ``rotary`` / ``qk_norm_rotary``: neox-style rope (rotate-half) of q and k, optionally after
  Qwen3's per-head RMSNorm; grid ``(num_tokens, 2)``, one program per token for q, one for k.
  With an ``mrope_section`` (Qwen2.5-VL's M-RoPE) a token has three positions, and each rotary
  frequency takes its cos/sin from the position of the section it falls in.
  ``rotary_into_cache``: the same kernel as the KV-cache write of a 16-bit cache (the models hand
  their rope to attention, ``engine.ops.attention.write_paged_kv``): the k program
  stores the roped K heads straight into the token's cache slot and copies V beside them, so one
  launch per layer ropes and writes. An FP8 cache's write kernel ropes with the helpers here
  (``_norm_halves``, ``_rope_halves``), the same roundings.
* ``silu_and_mul``: SwiGLU on a fused ``[gate | up]`` projection.
* ``rms_norm_fp8`` / ``silu_and_mul_fp8``: the same, written as the FP8 input of the linear that follows
  (``engine.models.fp8``): float8 values with one scale per token and 128 columns, so that no separate
  quantization kernel runs before the product (three launches per decoder layer fewer).

Numerics: every kernel rounds where the torch code in ``engine.models.layers`` rounds
(Hugging Face's order): the residual add in the model dtype; the norm in float32, cast to the
model dtype, then times the weight in the model dtype; rope with cos/sin rounded to the model
dtype and each product and sum rounded. Only reduction order and the float32 ``rsqrt``/``exp``
differ, so bfloat16 results agree with torch's to a rounding step at most, and float32 ones to
about 1e-6. Floating-point contraction (mul + add into fma) is turned off for the same reason.

All wrappers are out of place (inputs are never written), take rows with any stride as long
as the last dim is contiguous, and launch grids that depend only on shapes: they are safe to
capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.intmath import cdiv, next_power_of_2

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN_SIZE = 16384  # one row per program, held in registers
_ROPE_TILE = 2048  # elements per half-head tile of the rope kernel: heads are processed in groups this big
_SWIGLU_ROWS_FROM = 1024  # tokens from which the FP8 SwiGLU takes several rows a program


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _round(x, out_ptr):
    """``x`` (float32) rounded to ``out_ptr``'s element type and back: one torch op's rounding."""
    return x.to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_fp8_groups(v, cols, mask, q_row_ptr, s_row_ptr, stride_sg, first_group, num_groups):
    """``v`` [groups, group] float32, the columns ``cols`` of a row, one group per row of the tile, stored as
    float8_e4m3 with one float32 scale per group, the arithmetic of ``fp8_kernels.quantize_rows``: a group's
    absolute maximum maps to 448."""
    scale = tl.maximum(tl.max(tl.abs(v), 1) / 448.0, 1.1754943508222875e-38)
    tl.store(q_row_ptr + cols, (v / scale[:, None]).to(q_row_ptr.dtype.element_ty), mask=mask)
    groups = first_group + tl.arange(0, v.shape[0])
    tl.store(s_row_ptr + groups * stride_sg, scale, mask=groups < num_groups)


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
    the whole product would have been (``layers.PartialSums``)."""
    COLS: tl.constexpr = 128 if BLOCK >= 128 else BLOCK
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    in_row = offs < hidden_size
    mask = in_row & (row < num_rows) if FP8_GROUP > 0 else in_row
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM_SLICES > 1:
        for i in tl.static_range(1, NUM_SLICES):
            x += tl.load(x_ptr + i * stride_xs + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        x = _round(x, out_ptr)
    if COL_SCALES:
        x = _round(x * tl.load(col_scale_ptr + offs, mask=in_row, other=0.0), out_ptr)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, out_ptr)  # the residual stream is kept in the model dtype
        tl.store(residual_out_ptr + row * stride_ro + offs, x.to(residual_out_ptr.dtype.element_ty), mask=mask)
    rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / hidden_size + eps)
    w = tl.load(weight_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
    out = w * _round(x * rstd, out_ptr)  # cast back before the weight, like Hugging Face
    if FP8_GROUP > 0:
        _store_fp8_groups(_round(out, out_ptr), offs, in_row, q_ptr + row * stride_q, s_ptr + row * stride_s,
                          stride_sg, 0, tl.cdiv(hidden_size, FP8_GROUP))
    else:
        tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_halves(x1, x2, w1, w2, eps, out_ptr, HEAD_DIM: tl.constexpr):
    """Qwen3's per-head RMSNorm of rows given as their two halves (float32, padding zeros): the norm in float32,
    cast to the model dtype (``out_ptr``'s), then times the weight's halves ``w1``/``w2`` and rounded again."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
    return _round(w1 * _round(x1 * rstd, out_ptr), out_ptr), _round(w2 * _round(x2 * rstd, out_ptr), out_ptr)


@triton.jit
def _rope_halves(x1, x2, cos, sin, out_ptr):
    """Rotate-half of rows given as their two halves: ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``, float32, each
    product rounded to the model dtype (``out_ptr``'s) as torch rounds it; the caller rounds the sums."""
    o1 = _round(x1 * cos, out_ptr) - _round(x2 * sin, out_ptr)
    o2 = _round(x2 * cos, out_ptr) + _round(x1 * sin, out_ptr)
    return o1, o2


@triton.jit
def _norm_rope_heads(
    x_ptr, out_ptr, weight_ptr, col_scale_ptr, cos, sin, eps, num_heads, stride_h, stride_oh, stride_xs,
    HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
    COL_SCALES: tl.constexpr, NUM_SLICES: tl.constexpr,
):
    """One token's heads of q (or k), ``BLOCK_H`` at a time: optional per-head RMSNorm, then rotate-half.

    Each head is read as two halves ``x1 = x[:D/2]``, ``x2 = x[D/2:]``; ``cos``/``sin`` are
    ``[1, HALF_PAD]`` float32, already rounded to the model dtype. ``NUM_SLICES`` > 1: ``x`` is the first of that
    many partial products ``stride_xs`` apart, added in float32 and rounded to the model dtype once, as the whole
    product would have been (``layers.PartialSums``). ``COL_SCALES``: each value is then multiplied by its column's
    scale (``col_scale_ptr``, head h's at ``h * HEAD_DIM``) and rounded to the model dtype, as
    ``fp8_kernels.scale_columns_`` would have left it.
    """
    half = HEAD_DIM // 2
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < half
    if HAS_NORM:
        w1 = tl.load(weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & d_mask[None, :]
        in_ptrs = x_ptr + heads[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(in_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HALF_PAD]
        x2 = tl.load(in_ptrs + half, mask=mask, other=0.0).to(tl.float32)
        if NUM_SLICES > 1:
            for i in tl.static_range(1, NUM_SLICES):
                x1 += tl.load(in_ptrs + i * stride_xs, mask=mask, other=0.0).to(tl.float32)
                x2 += tl.load(in_ptrs + i * stride_xs + half, mask=mask, other=0.0).to(tl.float32)
            x1 = _round(x1, out_ptr)
            x2 = _round(x2, out_ptr)
        if COL_SCALES:
            scale_ptrs = col_scale_ptr + heads[:, None] * HEAD_DIM + offs_d[None, :]
            x1 = _round(x1 * tl.load(scale_ptrs, mask=mask, other=0.0), out_ptr)
            x2 = _round(x2 * tl.load(scale_ptrs + half, mask=mask, other=0.0), out_ptr)
        if HAS_NORM:
            x1, x2 = _norm_halves(x1, x2, w1, w2, eps, out_ptr, HEAD_DIM)
        # torch rounds every product and every sum: x1 * cos - x2 * sin, x2 * cos + x1 * sin.
        o1, o2 = _rope_halves(x1, x2, cos, sin, out_ptr)
        out_ptrs = out_ptr + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_slots", "stride_p", "stride_pr"])
def _rope_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_cache_ptr, slot_mapping_ptr, q_weight_ptr,
    k_weight_ptr, col_scale_ptr, cos_sin_ptr,
    eps, num_q_heads, num_k_heads, num_slots, stride_p, stride_pr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_qot, stride_qoh, stride_kot, stride_koh, stride_c,
    stride_xs,
    HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HAS_NORM: tl.constexpr, MROPE: tl.constexpr, SECTION_1: tl.constexpr, SECTION_2: tl.constexpr,
    CACHE: tl.constexpr, COL_SCALES: tl.constexpr, ROW_PAD: tl.constexpr, NUM_SLICES: tl.constexpr,
):
    """Program (t, 0) ropes token t's query heads into ``q_out``, program (t, 1) its key heads into ``k_out``.

    ``CACHE`` (the KV-cache write of a 16-bit cache, ``engine.ops.attention.write_paged_kv``):
    ``k_out``/``v_cache`` are the caches, and program (t, 1) stores the roped K heads straight into token t's
    slot (``slot_mapping``; a negative slot, or t past ``num_slots``, writes nothing) and copies its V row
    (``num_k_heads * HEAD_DIM`` values, ``ROW_PAD`` a power of two that holds them) beside it. ``COL_SCALES``:
    q|k|v's columns still need their scales (``col_scale_ptr``), applied to each value as it is read.
    ``NUM_SLICES`` > 1: q, k and v are views of the first of that many partial products of q|k|v, ``stride_xs``
    apart, which are added as they are read (``_norm_rope_heads``; V alike)."""
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HEAD_DIM // 2
    if MROPE:
        # Rows t, h, w of the [3, num_tokens] positions; frequency i reads row 0 below SECTION_1,
        # row 1 below SECTION_2, row 2 from there: one table row per frequency.
        p_t = tl.load(positions_ptr + tok * stride_p).to(tl.int64)
        p_h = tl.load(positions_ptr + stride_pr + tok * stride_p).to(tl.int64)
        p_w = tl.load(positions_ptr + 2 * stride_pr + tok * stride_p).to(tl.int64)
        pos = tl.where(offs_d < SECTION_1, p_t, tl.where(offs_d < SECTION_2, p_h, p_w))  # [HALF_PAD]
    else:
        pos = tl.load(positions_ptr + tok * stride_p).to(tl.int64)
    # Table row: [cos | sin], float32; rounded to the activation dtype first, as torch does.
    row_ptr = cos_sin_ptr + pos * stride_c
    cos = _round(tl.load(row_ptr + offs_d, mask=d_mask, other=0.0), q_out_ptr)[None, :]
    sin = _round(tl.load(row_ptr + HEAD_DIM // 2 + offs_d, mask=d_mask, other=0.0), q_out_ptr)[None, :]
    q_size = num_q_heads * HEAD_DIM
    if tl.program_id(1) == 0:
        _norm_rope_heads(q_ptr + tok * stride_qt, q_out_ptr + tok * stride_qot, q_weight_ptr, col_scale_ptr, cos,
                         sin, eps, num_q_heads, stride_qh, stride_qoh, stride_xs, HEAD_DIM, HALF_PAD, BLOCK_HQ,
                         HAS_NORM, COL_SCALES, NUM_SLICES)
    elif not CACHE:
        _norm_rope_heads(k_ptr + tok * stride_kt, k_out_ptr + tok * stride_kot, k_weight_ptr, col_scale_ptr + q_size,
                         cos, sin, eps, num_k_heads, stride_kh, stride_koh, stride_xs, HEAD_DIM, HALF_PAD, BLOCK_HK,
                         HAS_NORM, COL_SCALES, NUM_SLICES)
    else:
        slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_slots, other=-1).to(tl.int64)
        if slot >= 0:
            row = num_k_heads * HEAD_DIM
            _norm_rope_heads(k_ptr + tok * stride_kt, k_out_ptr + slot * row, k_weight_ptr, col_scale_ptr + q_size,
                             cos, sin, eps, num_k_heads, stride_kh, HEAD_DIM, stride_xs, HEAD_DIM, HALF_PAD, BLOCK_HK,
                             HAS_NORM, COL_SCALES, NUM_SLICES)
            offs = tl.arange(0, ROW_PAD)
            v = tl.load(v_ptr + tok * stride_vt + offs, mask=offs < row)
            if NUM_SLICES > 1:
                v = v.to(tl.float32)
                for i in tl.static_range(1, NUM_SLICES):
                    v += tl.load(v_ptr + i * stride_xs + tok * stride_vt + offs, mask=offs < row).to(tl.float32)
                v = v.to(v_cache_ptr.dtype.element_ty)
            if COL_SCALES:
                scales = tl.load(col_scale_ptr + q_size + row + offs, mask=offs < row, other=0.0)
                v = (v.to(tl.float32) * scales).to(v_cache_ptr.dtype.element_ty)
            tl.store(v_cache_ptr + slot * row + offs, v, mask=offs < row)


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
    (``layers.PartialSums``)."""
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
            gate = _round(gate, out_ptr)
            up = _round(up, out_ptr)
        if COL_SCALES:
            gate = _round(gate * gate_scales, out_ptr)
            up = _round(up * up_scales, out_ptr)
        act = _round(gate / (1.0 + tl.exp(-gate)), out_ptr)  # F.silu, rounded to the model dtype
        if FP8_GROUP > 0:
            stored = row < num_padded
            _store_fp8_groups(_round(act * up, out_ptr), offs, in_row & stored, q_row_ptr=q_ptr + row * stride_q,
                              s_row_ptr=s_ptr + row * stride_s, stride_sg=stride_sg,
                              first_group=tl.program_id(1) * (BLOCK // FP8_GROUP),
                              num_groups=tl.where(stored, tl.cdiv(inter_size, FP8_GROUP), 0))
        else:
            tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _runs_on(t: torch.Tensor) -> bool:
    """CUDA tensors always; CPU tensors only when the kernels were built by Triton's interpreter."""
    return t.is_cuda or not isinstance(_rms_norm_kernel, triton.runtime.JITFunction)


def _check_activation(name: str, what: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name}: {what} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: {what} dtype {t.dtype} is not supported (one of {SUPPORTED_DTYPES})")
    if not _runs_on(t):
        raise ValueError(f"{name}: {what} is on {t.device}: the kernels need CUDA tensors (or TRITON_INTERPRET=1)")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name}: {what} must be contiguous in its last dim, got strides {t.stride()}")


def _check_weight(name: str, what: str, w: torch.Tensor, size: int, like: torch.Tensor) -> None:
    if w.shape != (size,) or w.dtype != like.dtype or w.device != like.device or w.stride(0) != 1:
        raise ValueError(f"{name}: {what} must be a contiguous ({size},) {like.dtype} tensor on {like.device}, "
                         f"got {tuple(w.shape)} {w.dtype} on {w.device} with strides {w.stride()}")


def _check_column_scales(name: str, scales: torch.Tensor, width: int, like: torch.Tensor) -> None:
    if (scales.shape != (width,) or scales.dtype != torch.float32 or scales.device != like.device
            or scales.stride(0) != 1):
        raise ValueError(f"{name}: column_scales must be a contiguous ({width},) float32 tensor on {like.device}, "
                         f"got {tuple(scales.shape)} {scales.dtype} on {scales.device}")


def _norm_launch(hidden_size: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the whole row in one tile, about 8 to 32 elements per thread."""
    block = next_power_of_2(hidden_size)
    return block, min(max(block // 256, 1), 16)


# --------------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------------


def _fp8_output(name: str, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values, scales, group): room for ``x``'s rows of ``width`` columns quantized as cuBLAS's block-scaled
    product takes them (``fp8_kernels.empty_quantized``), after checking that the width splits into groups."""
    from engine.ops.fp8 import GROUP, empty_quantized

    if width % GROUP:
        raise ValueError(f"{name}: FP8 output needs a width that is a multiple of {GROUP}, got {width}")
    return (*empty_quantized(x.shape[0], width, GROUP, x.device, cublas_layout=True), GROUP)


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
    ``column_scales`` (float32 [hidden]): scales ``x``'s columns still need (``Fp8Weights.matmul_deferring_scales``),
    each product rounded to the model dtype before the add, as if ``x`` had been multiplied by them first.
    ``x`` may be [num_slices, num_tokens, hidden] (no ``column_scales`` then): partial products of K's slices whose sum
    is the input, added in float32 and rounded to the model dtype once (``layers.PartialSums``)."""
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


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    mrope_section: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim].

    ``cos_sin_cache`` is [max_position, head_dim] float32, cos in the first half and sin in the
    second; ``positions`` [tokens] int32/int64, any order, each below max_position (not checked:
    that would need a host sync). q and k may be strided views (e.g. of a fused qkv output).
    Returns new contiguous tensors ``(q_out, k_out)``.

    ``mrope_section`` (M-RoPE, Qwen2.5-VL): ``positions`` is [3, tokens] (temporal, height, width;
    any strides), and the ``head_dim // 2`` rotary frequencies split into three runs of these
    lengths, the first reading row 0, the second row 1, the third row 2.
    """
    return _rope("rotary", positions, q, k, cos_sin_cache, None, None, 0.0, mrope_section)


def qk_norm_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,  # [head_dim], in q's dtype
    k_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    mrope_section: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k (over head_dim), then ``rotary``; one kernel, out of place."""
    return _rope("qk_norm_rotary", positions, q, k, cos_sin_cache, q_weight, k_weight, eps, mrope_section)


def _check_positions(name: str, positions: torch.Tensor, num_tokens: int, head_dim: int,
                     mrope_section: tuple[int, int, int] | None) -> tuple[int, int, int, int]:
    """(token stride, row stride, end of section 0, end of section 1) of valid positions for the kernel."""
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: positions must be int32/int64, got {positions.dtype}")
    if mrope_section is None:
        if positions.shape != (num_tokens,):
            raise ValueError(f"{name}: positions must have shape ({num_tokens},), got {tuple(positions.shape)}")
        return positions.stride(0), 0, 0, 0
    if len(mrope_section) != 3 or min(mrope_section) < 0 or sum(mrope_section) != head_dim // 2:
        raise ValueError(f"{name}: mrope_section must be three lengths adding up to head_dim // 2 = "
                         f"{head_dim // 2}, got {tuple(mrope_section)}")
    if positions.shape != (3, num_tokens):
        raise ValueError(f"{name}: M-RoPE positions must have shape (3, {num_tokens}), got {tuple(positions.shape)}")
    return positions.stride(1), positions.stride(0), mrope_section[0], mrope_section[0] + mrope_section[1]


def check_rope_inputs(
    name: str,
    positions: torch.Tensor,
    q: torch.Tensor,  # [num_tokens, heads, head_dim]: positions name q's rows
    k: torch.Tensor,  # [any rows, kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    mrope_section: tuple[int, int, int] | None,
    column_scales: torch.Tensor | None = None,
) -> tuple[int, int, int, int]:
    """Raise ValueError unless the arguments suit the rope kernels (``rotary``'s, ``qk_norm_rotary``'s, and the
    KV-cache writes that rope on the way, ``engine.ops.attention.write_paged_kv``); return
    ``_check_positions``' strides and section ends. ``column_scales``: float32, one per column of q|k|v."""
    _check_activation(name, "q", q, 3)
    _check_activation(name, "k", k, 3)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[2] != head_dim or k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"{name}: k must be [tokens, kv_heads, {head_dim}] {q.dtype} on {q.device}, "
                         f"got {tuple(k.shape)} {k.dtype} on {k.device}")
    if head_dim % 2 != 0:
        raise ValueError(f"{name}: head_dim must be even, got {head_dim}")
    strides = _check_positions(name, positions, num_tokens, head_dim, mrope_section)
    if (cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32
            or cos_sin_cache.stride(1) != 1):
        raise ValueError(f"{name}: cos_sin_cache must be [max_position, {head_dim}] float32 with a contiguous "
                         f"last dim, got {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype}")
    for what, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != q.device:
            raise ValueError(f"{name}: {what} is on {t.device}, q on {q.device}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError(f"{name}: q_weight and k_weight go together")
    if q_weight is not None:
        _check_weight(name, "q_weight", q_weight, head_dim, q)
        _check_weight(name, "k_weight", k_weight, head_dim, q)
    if column_scales is not None:  # one per column of q|k|v
        _check_column_scales(name, column_scales, (num_q_heads + 2 * k.shape[1]) * head_dim, q)
    return strides


def _rope(
    name: str,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    mrope_section: tuple[int, int, int] | None,
    column_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    stride_p, stride_pr, section_1, section_2 = check_rope_inputs(name, positions, q, k, cos_sin_cache, q_weight,
                                                                  k_weight, mrope_section, column_scales)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens:
        raise ValueError(f"{name}: k must have q's {num_tokens} rows, got {tuple(k.shape)}")
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _launch_rope(positions, q, k, q_out, k_out, q_weight, k_weight, eps, cos_sin_cache, mrope_section, stride_p,
                 stride_pr, section_1, section_2, column_scales=column_scales)
    return q_out, k_out


def rotary_with_column_scales(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
    mrope_section: tuple[int, int, int] | None = None, column_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary`` (``qk_norm_rotary`` with the weights), q's and k's values first times their columns' scales
    (``column_scales``, float32 over q|k|v's columns, v's unused here; each product rounded to the model dtype)."""
    return _rope("rotary_with_column_scales", positions, q, k, cos_sin_cache, q_weight, k_weight, eps, mrope_section,
                 column_scales)


def rotary_into_cache(
    positions: torch.Tensor,  # [num_tokens]; [3, num_tokens] with mrope_section
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [>= num_slots, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], contiguous, k's dtype
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_slots] int64; a negative slot is skipped
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    mrope_section: tuple[int, int, int] | None = None,
    column_scales: torch.Tensor | None = None,  # float32 [(heads + 2 * kv_heads) * head_dim]
    partials: torch.Tensor | None = None,  # [num_slices, num_tokens, (heads + 2 * kv_heads) * head_dim]
) -> torch.Tensor:
    """``rotary`` (``qk_norm_rotary`` with the weights) in one launch with a 16-bit (or float32) KV cache's write:
    every row of q roped into a new tensor, which is returned; the first ``num_slots`` rows of k roped straight
    into their cache slots and those of v copied beside them, no k_out in between (the same values ``rotary`` and
    a plain write would store). ``partials``: q|k|v is the sum of these partial products (``layers.PartialSums``,
    the q|k|v product cut along K), rounded once to the model dtype, and q, k and v are the first one's views; the
    kernel adds them as it reads them. ``column_scales``: q|k|v's columns times these then, each product rounded to
    the model dtype (``fp8_kernels.scale_columns_``'s arithmetic). The cache arguments are
    ``engine.ops.attention.write_paged_kv``'s, which checks them and calls this."""
    name = "write_paged_kv"
    stride_p, stride_pr, section_1, section_2 = check_rope_inputs(name, positions, q, k, cos_sin_cache, q_weight,
                                                                  k_weight, mrope_section, column_scales)
    if partials is not None:
        _check_partials(name, partials, q, k, v)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] > 0:
        _launch_rope(positions, q, k, q_out, k_cache, q_weight, k_weight, eps, cos_sin_cache, mrope_section, stride_p,
                     stride_pr, section_1, section_2, cache=(v, v_cache, slot_mapping), column_scales=column_scales,
                     partials=partials)
    return q_out


def _check_partials(name: str, partials: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k and v are the q|k|v columns of ``partials[0]`` ([num_slices, tokens, width]), so
    that the kernel finds every slice's values ``partials.stride(0)`` elements after the first's."""
    if partials.dim() != 3 or not 1 <= partials.shape[0] <= 16 or partials.dtype != q.dtype:
        raise ValueError(f"{name}: partials must be [1 to 16 slices, tokens, q|k|v width] {q.dtype}, got "
                         f"{tuple(partials.shape)} {partials.dtype}")
    width, size = partials.shape[2], partials.element_size()
    offset = 0
    for what, t in (("q", q), ("k", k), ("v", v)):
        columns = t.shape[1] * t.shape[2]
        # A dimension of one row or one head may have any stride (a view picks one): only a longer one's counts.
        if (t.data_ptr() != partials.data_ptr() + offset * size or t.shape[0] != partials.shape[1]
                or (t.shape[0] > 1 and t.stride(0) != partials.stride(1))
                or (t.shape[1] > 1 and t.stride(1) != t.shape[2])):
            raise ValueError(f"{name}: {what} must be a view of columns {offset}..{offset + columns} of partials[0]")
        offset += columns
    if offset != width or partials.stride(2) != 1:
        raise ValueError(f"{name}: partials' rows must be q|k|v, {offset} contiguous columns, got {width} with "
                         f"strides {partials.stride()}")


def _launch_rope(positions, q, k, q_out, k_out, q_weight, k_weight, eps, cos_sin_cache, mrope_section, stride_p,
                 stride_pr, section_1, section_2, cache=None, column_scales=None, partials=None) -> None:
    """``_rope_kernel`` on checked arguments; ``cache`` = (v, v_cache, slot_mapping): ``k_out`` is the K cache;
    ``partials`` checked by ``_check_partials``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half_pad = next_power_of_2(head_dim // 2)
    heads_per_tile = max(_ROPE_TILE // half_pad, 1)
    has_norm = q_weight is not None
    v, v_cache, slot_mapping = cache if cache is not None else (k, k_out, positions)  # unused without a cache
    _rope_kernel[(num_tokens, 2)](
        positions, q, k, v, q_out, k_out, v_cache, slot_mapping, q_weight if has_norm else q,
        k_weight if has_norm else k, column_scales if column_scales is not None else q, cos_sin_cache,
        float(eps), num_q_heads, num_k_heads, slot_mapping.shape[0], stride_p, stride_pr,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        partials.stride(0) if partials is not None else 0,
        HEAD_DIM=head_dim, HALF_PAD=half_pad,
        BLOCK_HQ=min(next_power_of_2(num_q_heads), heads_per_tile),
        BLOCK_HK=min(next_power_of_2(max(num_k_heads, 1)), heads_per_tile),
        HAS_NORM=has_norm, MROPE=mrope_section is not None, SECTION_1=section_1, SECTION_2=section_2,
        CACHE=cache is not None, COL_SCALES=column_scales is not None,
        ROW_PAD=next_power_of_2(num_k_heads * head_dim) if cache is not None else 1,
        NUM_SLICES=partials.shape[0] if partials is not None else 1,
        num_warps=4, enable_fp_fusion=False,
    )


def silu_and_mul(x: torch.Tensor, fp8: bool = False, column_scales: torch.Tensor | None = None):
    """SwiGLU of ``x`` [num_tokens, 2 * inter] (any row stride): ``silu(gate) * up``, [num_tokens, inter]
    (with ``fp8``, ``silu_and_mul_fp8``'s result). ``column_scales`` (float32 [2 * inter]): the SwiGLU of
    ``x`` times them, each product rounded to ``x``'s dtype, as ``fp8_kernels.scale_columns_`` would leave it.
    ``x`` may be [num_slices, num_tokens, 2 * inter], partial products of gate|up (``layers.PartialSums``): their
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
