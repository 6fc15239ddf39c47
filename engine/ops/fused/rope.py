"""Neox-style rope of q and k (rotate-half), after Qwen3's per-head RMSNorm where it has one; M-RoPE's three positions.

``rotary`` and ``qk_norm_rotary`` check their inputs and return new tensors. The KV-cache write
(``engine.ops.attention``) launches the same kernel with the write of a 16-bit cache (``launch_rope_into_cache``) or
before the write of an FP8 one (``launch_rope``); those two take arguments the write checked (``check_rope_tables``
when a layer is bound, ``check_rope_inputs`` and ``check_partials`` on the checked one-shot calls).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.fused.checks import _check_activation, _check_column_scales, _check_weight
from engine.ops.intmath import next_power_of_2
from engine.ops.triton_helpers import norm_halves, rope_halves, round_to

_ROPE_TILE = 2048  # elements per half-head tile of the rope kernel: heads are processed in groups this big


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
    product would have been (``LinearOutput``). ``COL_SCALES``: each value is then multiplied by its column's
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
            x1 = round_to(x1, out_ptr)
            x2 = round_to(x2, out_ptr)
        if COL_SCALES:
            scale_ptrs = col_scale_ptr + heads[:, None] * HEAD_DIM + offs_d[None, :]
            x1 = round_to(x1 * tl.load(scale_ptrs, mask=mask, other=0.0), out_ptr)
            x2 = round_to(x2 * tl.load(scale_ptrs + half, mask=mask, other=0.0), out_ptr)
        if HAS_NORM:
            x1, x2 = norm_halves(x1, x2, w1, w2, eps, out_ptr, HEAD_DIM)
        # torch rounds every product and every sum: x1 * cos - x2 * sin, x2 * cos + x1 * sin.
        o1, o2 = rope_halves(x1, x2, cos, sin, out_ptr)
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
    cos = round_to(tl.load(row_ptr + offs_d, mask=d_mask, other=0.0), q_out_ptr)[None, :]
    sin = round_to(tl.load(row_ptr + HEAD_DIM // 2 + offs_d, mask=d_mask, other=0.0), q_out_ptr)[None, :]
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
) -> tuple[torch.Tensor, torch.Tensor]:
    check_rope_inputs(name, positions, q, k, cos_sin_cache, q_weight, k_weight, mrope_section)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: k must have q's {q.shape[0]} rows, got {tuple(k.shape)}")
    return launch_rope(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, mrope_section)


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def check_rope_tables(
    name: str,
    head_dim: int,
    device: torch.device,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    mrope_section: tuple[int, int, int] | None,
) -> None:
    """Raise ValueError unless what a layer's rope holds for every step suits the kernels: the cos/sin table, Qwen3's
    norm weights (their dtype is checked against the queries' by ``check_rope_inputs``), M-RoPE's sections."""
    if head_dim % 2 != 0:
        raise ValueError(f"{name}: head_dim must be even, got {head_dim}")
    if (cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32
            or cos_sin_cache.stride(1) != 1):
        raise ValueError(f"{name}: cos_sin_cache must be [max_position, {head_dim}] float32 with a contiguous "
                         f"last dim, got {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype}")
    if cos_sin_cache.device != device:
        raise ValueError(f"{name}: cos_sin_cache is on {cos_sin_cache.device}, q on {device}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError(f"{name}: q_weight and k_weight go together")
    if q_weight is not None:
        _check_weight(name, "q_weight", q_weight, head_dim, q_weight)
        _check_weight(name, "k_weight", k_weight, head_dim, q_weight)
        if q_weight.device != device:
            raise ValueError(f"{name}: q_weight is on {q_weight.device}, q on {device}")
    if mrope_section is not None and (len(mrope_section) != 3 or min(mrope_section) < 0
                                      or sum(mrope_section) != head_dim // 2):
        raise ValueError(f"{name}: mrope_section must be three lengths adding up to head_dim // 2 = "
                         f"{head_dim // 2}, got {tuple(mrope_section)}")


def _check_positions(name: str, positions: torch.Tensor, num_tokens: int,
                     mrope_section: tuple[int, int, int] | None) -> None:
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: positions must be int32/int64, got {positions.dtype}")
    if mrope_section is None and positions.shape != (num_tokens,):
        raise ValueError(f"{name}: positions must have shape ({num_tokens},), got {tuple(positions.shape)}")
    if mrope_section is not None and positions.shape != (3, num_tokens):
        raise ValueError(f"{name}: M-RoPE positions must have shape (3, {num_tokens}), got {tuple(positions.shape)}")


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
) -> None:
    """Raise ValueError unless the arguments suit the rope kernels (``rotary``'s, ``qk_norm_rotary``'s, and the
    KV-cache writes that rope on the way, ``engine.ops.attention.write_paged_kv``). ``column_scales``: float32, one
    per column of q|k|v."""
    _check_activation(name, "q", q, 3)
    _check_activation(name, "k", k, 3)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[2] != head_dim or k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"{name}: k must be [tokens, kv_heads, {head_dim}] {q.dtype} on {q.device}, "
                         f"got {tuple(k.shape)} {k.dtype} on {k.device}")
    check_rope_tables(name, head_dim, q.device, cos_sin_cache, q_weight, k_weight, mrope_section)
    _check_positions(name, positions, num_tokens, mrope_section)
    if positions.device != q.device:
        raise ValueError(f"{name}: positions is on {positions.device}, q on {q.device}")
    if q_weight is not None:
        _check_weight(name, "q_weight", q_weight, head_dim, q)
    if column_scales is not None:  # one per column of q|k|v
        _check_column_scales(name, column_scales, (num_q_heads + 2 * k.shape[1]) * head_dim, q)


def check_partials(name: str, partials: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
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


# --------------------------------------------------------------------------------------------
# Launches on checked arguments
# --------------------------------------------------------------------------------------------


def rope_strides(positions: torch.Tensor, mrope_section: tuple[int, int, int] | None) -> tuple[int, int, int, int]:
    """(token stride, row stride, end of section 0, end of section 1) of the positions, as the kernels take them."""
    if mrope_section is None:
        return positions.stride(0), 0, 0, 0
    return positions.stride(1), positions.stride(0), mrope_section[0], mrope_section[0] + mrope_section[1]


def launch_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
    mrope_section: tuple[int, int, int] | None = None, column_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary`` (``qk_norm_rotary`` with the weights) on checked arguments (k with q's rows), q's and k's values
    first times their columns' scales with ``column_scales`` (float32 over q|k|v's columns, v's unused here; each
    product rounded to the model dtype): new ``(q_out, k_out)``."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0] > 0:
        _launch_rope_kernel(positions, q, k, q_out, k_out, q_weight, k_weight, eps, cos_sin_cache, mrope_section,
                            column_scales=column_scales)
    return q_out, k_out


def launch_rope_into_cache(
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
    """``rotary`` (``qk_norm_rotary`` with the weights) in one launch with a 16-bit (or float32) KV cache's write, on
    checked arguments (``engine.ops.attention`` checks them): every row of q roped into a new tensor, which is
    returned; the first ``num_slots`` rows of k roped straight into their cache slots and those of v copied beside
    them, no k_out in between (the same values ``rotary`` and a plain write would store). ``partials``: q|k|v is the
    sum of these partial products (``LinearOutput``, the q|k|v product cut along K), rounded once to the model
    dtype, and q, k and v are the first one's views (``check_partials``); the kernel adds them as it reads them.
    ``column_scales``: q|k|v's columns times these then, each product rounded to the model dtype
    (``fp8_kernels.scale_columns_``'s arithmetic)."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] > 0:
        _launch_rope_kernel(positions, q, k, q_out, k_cache, q_weight, k_weight, eps, cos_sin_cache, mrope_section,
                            cache=(v, v_cache, slot_mapping), column_scales=column_scales, partials=partials)
    return q_out


def _launch_rope_kernel(positions, q, k, q_out, k_out, q_weight, k_weight, eps, cos_sin_cache, mrope_section,
                        cache=None, column_scales=None, partials=None) -> None:
    """``_rope_kernel``; ``cache`` = (v, v_cache, slot_mapping): ``k_out`` is the K cache."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half_pad = next_power_of_2(head_dim // 2)
    heads_per_tile = max(_ROPE_TILE // half_pad, 1)
    has_norm = q_weight is not None
    stride_p, stride_pr, section_1, section_2 = rope_strides(positions, mrope_section)
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
