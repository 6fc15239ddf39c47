"""The KV-cache write of an FP8 cache: each head's row of K and V scaled to an absolute maximum of 448 and stored as
float8_e4m3 with its scale beside it, K rotated first (``kvcache.paged_cache``); the step's queries rotated alike in
the same launch, and, where the rope is fused in (``fuse_rope``), q and k roped on the way.

Every rounding is that of the separate kernels: the rope kernel's (``engine.ops.fused.rope``, through the helpers of
``engine.ops.triton_helpers``), then ``kvcache.paged_cache``'s rotation and quantization.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.ops.attention.launch import _dot_precision, _splits_queries, _write_tokens
from engine.ops.fused import rope_strides
from engine.ops.intmath import cdiv, next_power_of_2
from engine.ops.triton_helpers import interpreted, jit_without_specializing, norm_halves, rope_halves, round_to
from kvcache.paged_cache import rotates_keys


@triton.jit
def _hadamard(rows, cols, dtype):
    """Entries (rows[i], cols[j]) of Sylvester's H in ``dtype``: -1 where ``row & col`` has an odd number of set bits.
    Its +-1 entries are exact in any dtype, so 16-bit operands take the tensor cores with exact products."""
    bits = rows[:, None] & cols[None, :]
    bits = bits ^ (bits >> 4)  # HEAD_DIM <= 256: eight bits fold into the lowest
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    return (1 - 2 * (bits & 1)).to(dtype)


@triton.jit
def _rotate_rows(x, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Rows of ``x`` [rows, HEAD_DIM] times H / sqrt(HEAD_DIM), float32 out (``kvcache.paged_cache.rotate_heads``)."""
    idx = tl.arange(0, HEAD_DIM)
    return tl.dot(x, _hadamard(idx, idx, x.dtype), input_precision=DOT_PRECISION) * (1.0 / tl.sqrt(HEAD_DIM * 1.0))


@triton.jit
def _rotate_halves(x1, x2, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``_rotate_rows`` of rows given as their halves ``x1 = x[:, :D/2]``, ``x2 = x[:, D/2:]``: ``x1 @ H[:D/2] + x2 @
    H[D/2:]``, the second product accumulated onto the first as one dot over the whole row accumulates its steps,
    so that the halves are never interleaved in registers."""
    HALF: tl.constexpr = HEAD_DIM // 2
    idx = tl.arange(0, HALF)
    cols = tl.arange(0, HEAD_DIM)
    acc = tl.dot(x1, _hadamard(idx, cols, x1.dtype), input_precision=DOT_PRECISION)
    acc = tl.dot(x2, _hadamard(idx + HALF, cols, x2.dtype), acc, input_precision=DOT_PRECISION)
    return acc * (1.0 / tl.sqrt(HEAD_DIM * 1.0))


@triton.jit
def _to_e4m3(x, INTERPRET: tl.constexpr):
    """float32 ``x`` (within +-448) rounded to float8_e4m3, to nearest even.

    Triton's interpreter (3.8) rounds a value that carries into the next power of two to half of it (31.9 to 16,
    about 1% of values). With ``INTERPRET`` each value is first rounded in float32, so that the conversion is exact:
    normal values to e4m3's 3 mantissa bits in float32's own bits, subnormal ones (below 2^-6) to a multiple of
    2^-9 by adding and taking away 1.5 * 2^14, where float32's spacing is 2^-9. GPUs convert in hardware."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        x = tl.where(tl.abs(x) < 0.015625, (x + 24576.0) - 24576.0, bits.to(tl.float32, bitcast=True))
    return x.to(tl.float8e4nv)


@triton.jit
def _fp8_scale(row_max):
    """A row's FP8 scale from its absolute maximum: that maximum maps to 448 (float8_e4m3's largest value)."""
    return tl.maximum(row_max / 448.0, 1.1754943508222875e-38)  # float32's smallest normal


@triton.jit
def _slot_rows(slot_mapping_ptr, first, num_slots, HEADS_PAD: tl.constexpr, TOKENS: tl.constexpr):
    """(token, head, slot) of each row of a tile of tokens ``first ..first + TOKENS``: row r is head r % HEADS_PAD of
    token r // HEADS_PAD; tokens past ``num_slots`` get slot -1."""
    offs_r = tl.arange(0, TOKENS * HEADS_PAD)
    tok = first + offs_r // HEADS_PAD
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_slots, other=-1).to(tl.int64)
    return tok.to(tl.int64), offs_r % HEADS_PAD, slot


@triton.jit
def _roped_rows(x_ptr, stride_t, stride_h, tok, head, mask, positions_ptr, cos_sin_ptr, weight_ptr, col_scale_ptr,
                eps, stride_p, stride_pr, stride_c, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
                HAS_NORM: tl.constexpr, MROPE: tl.constexpr, SECTION_1: tl.constexpr, SECTION_2: tl.constexpr,
                COL_SCALES: tl.constexpr):
    """The rows (token ``tok``, head ``head``, each [rows]; ``mask`` the real ones) of q or k as the rope kernel leaves
    them (``engine.ops.fused.rope._rope_kernel``, the same roundings): times their columns' scales with
    ``COL_SCALES`` (head h's at ``col_scale_ptr + h * HEAD_DIM``), normed with ``HAS_NORM``, roped at their tokens'
    positions. Returns their halves (x[:D/2], x[D/2:]), [rows, HALF_PAD] float32 holding values of ``x_ptr``'s dtype,
    zeros in the padding."""
    half = HEAD_DIM // 2
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < half
    m = mask[:, None] & d_mask[None, :]
    ptrs = x_ptr + (tok * stride_t + head * stride_h)[:, None] + offs_d[None, :]
    x1 = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + half, mask=m, other=0.0).to(tl.float32)
    if COL_SCALES:
        scale_ptrs = col_scale_ptr + (head * HEAD_DIM)[:, None] + offs_d[None, :]
        x1 = round_to(x1 * tl.load(scale_ptrs, mask=m, other=0.0), x_ptr)
        x2 = round_to(x2 * tl.load(scale_ptrs + half, mask=m, other=0.0), x_ptr)
    if HAS_NORM:
        w1 = tl.load(weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x1, x2 = norm_halves(x1, x2, w1, w2, eps, x_ptr, HEAD_DIM)
    p_ptrs = positions_ptr + tok * stride_p
    if MROPE:  # as in the rope kernel: frequency i reads row 0 below SECTION_1, row 1 below SECTION_2, else row 2
        p_t = tl.load(p_ptrs, mask=mask, other=0).to(tl.int64)[:, None]
        p_h = tl.load(p_ptrs + stride_pr, mask=mask, other=0).to(tl.int64)[:, None]
        p_w = tl.load(p_ptrs + 2 * stride_pr, mask=mask, other=0).to(tl.int64)[:, None]
        freq = offs_d[None, :]
        pos = tl.where(freq < SECTION_1, p_t, tl.where(freq < SECTION_2, p_h, p_w))  # [rows, HALF_PAD]
    else:
        pos = tl.load(p_ptrs, mask=mask, other=0).to(tl.int64)[:, None]
    table = cos_sin_ptr + pos * stride_c + offs_d[None, :]
    cos = round_to(tl.load(table, mask=m, other=0.0), x_ptr)  # rounded to the activation dtype, as torch does
    sin = round_to(tl.load(table + half, mask=m, other=0.0), x_ptr)
    o1, o2 = rope_halves(x1, x2, cos, sin, x_ptr)
    return round_to(o1, x_ptr), round_to(o2, x_ptr)


@triton.jit
def _store_fp8_rows(x_ptr, stride_t, cache_ptr, scale_ptr, slot_mapping_ptr, col_scale_ptr, first, num_slots,
                    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    TOKENS: tl.constexpr, ROTATE: tl.constexpr, COL_SCALES: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize the [num_kv_heads, head_dim] row blocks of tokens ``first ..first + TOKENS`` (rotated first if
    ``ROTATE``; times their columns' scales first, each product rounded to the model dtype, with ``COL_SCALES``) into
    their FP8 cache slots, scales beside them. Row r of the tile is head r % HEADS_PAD of token r // HEADS_PAD (a
    row holds ``D_PAD`` >= HEAD_DIM columns); tokens past ``num_slots``, and slots < 0, write nothing."""
    tok, head, slot = _slot_rows(slot_mapping_ptr, first, num_slots, HEADS_PAD, TOKENS)
    offs_d = tl.arange(0, D_PAD)
    mask = (head < NUM_KV_HEADS) & (slot >= 0)
    m = mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + tok[:, None] * stride_t + (head * HEAD_DIM)[:, None] + offs_d[None, :], mask=m, other=0.0)
    if COL_SCALES:
        scales = tl.load(col_scale_ptr + (head * HEAD_DIM)[:, None] + offs_d[None, :], mask=m, other=0.0)
        x = (x.to(tl.float32) * scales).to(x_ptr.dtype.element_ty)
    x = _rotate_rows(x, HEAD_DIM, DOT_PRECISION) if ROTATE else x.to(tl.float32)
    scale = _fp8_scale(tl.max(tl.abs(x), 1))
    row = slot * NUM_KV_HEADS + head
    tl.store(cache_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], _to_e4m3(x / scale[:, None], INTERPRET), mask=m)
    tl.store(scale_ptr + row, scale, mask=mask)


@triton.jit
def _store_roped_fp8_rows(x_ptr, stride_t, stride_h, cache_ptr, scale_ptr, slot_mapping_ptr, first, num_slots,
                          positions_ptr, cos_sin_ptr, weight_ptr, col_scale_ptr, eps, stride_p, stride_pr, stride_c,
                          NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HALF_PAD: tl.constexpr, TOKENS: tl.constexpr, ROTATE: tl.constexpr,
                          HAS_NORM: tl.constexpr, MROPE: tl.constexpr, SECTION_1: tl.constexpr,
                          SECTION_2: tl.constexpr, COL_SCALES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          INTERPRET: tl.constexpr):
    """``_store_fp8_rows`` of K rows that still need their rope (``_roped_rows``): the roped rows, rounded to the
    model dtype as the rope kernel would have stored them, are rotated (``_rotate_halves``) and quantized as
    ``_store_fp8_rows`` quantizes rows it loads."""
    tok, head, slot = _slot_rows(slot_mapping_ptr, first, num_slots, HEADS_PAD, TOKENS)
    mask = (head < NUM_KV_HEADS) & (slot >= 0)
    x1, x2 = _roped_rows(x_ptr, stride_t, stride_h, tok, head, mask, positions_ptr, cos_sin_ptr, weight_ptr,
                         col_scale_ptr, eps, stride_p, stride_pr, stride_c, HEAD_DIM, HALF_PAD, HAS_NORM, MROPE,
                         SECTION_1, SECTION_2, COL_SCALES)
    row = slot * NUM_KV_HEADS + head
    if ROTATE:
        dtype = x_ptr.dtype.element_ty
        x = _rotate_halves(x1.to(dtype), x2.to(dtype), HEAD_DIM, DOT_PRECISION)
        scale = _fp8_scale(tl.max(tl.abs(x), 1))
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(cache_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], _to_e4m3(x / scale[:, None], INTERPRET),
                 mask=mask[:, None])
    else:
        scale = _fp8_scale(tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1)))
        offs_d = tl.arange(0, HALF_PAD)
        m = mask[:, None] & (offs_d < HEAD_DIM // 2)[None, :]
        ptrs = cache_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(ptrs, _to_e4m3(x1 / scale[:, None], INTERPRET), mask=m)
        tl.store(ptrs + HEAD_DIM // 2, _to_e4m3(x2 / scale[:, None], INTERPRET), mask=m)
    tl.store(scale_ptr + row, scale, mask=mask)


@triton.jit
def _store_queries(q_ptr, q_out_ptr, first, num_rows, stride_qt, stride_qh, stride_qot, stride_qoh,
                   positions_ptr, cos_sin_ptr, weight_ptr, col_scale_ptr, eps, stride_p, stride_pr, stride_c,
                   NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HALF_PAD: tl.constexpr, TOKENS: tl.constexpr, ROTATE: tl.constexpr, ROPE: tl.constexpr,
                   HAS_NORM: tl.constexpr, MROPE: tl.constexpr, SECTION_1: tl.constexpr, SECTION_2: tl.constexpr,
                   COL_SCALES: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_CHUNK: tl.constexpr):
    """The queries of tokens ``first ..first + TOKENS`` (those below ``num_rows``) into ``q_out``: roped with ``ROPE``
    (``_roped_rows``), then rotated with ``ROTATE``. Roped, ``Q_CHUNK`` heads of the tokens at a time: all of them
    in one tile (32 heads, 4 tokens) spilled registers (bench/RESULTS.md)."""
    dtype = q_out_ptr.dtype.element_ty
    if ROPE:
        for h0 in range(0, Q_HEADS_PAD, Q_CHUNK):
            offs_r = tl.arange(0, TOKENS * Q_CHUNK)
            tok = (first + offs_r // Q_CHUNK).to(tl.int64)
            head = h0 + offs_r % Q_CHUNK
            mask = (head < NUM_Q_HEADS) & (tok < num_rows)
            out_rows = q_out_ptr + (tok * stride_qot + head * stride_qoh)[:, None]
            q1, q2 = _roped_rows(q_ptr, stride_qt, stride_qh, tok, head, mask, positions_ptr, cos_sin_ptr,
                                 weight_ptr, col_scale_ptr, eps, stride_p, stride_pr, stride_c, HEAD_DIM, HALF_PAD,
                                 HAS_NORM, MROPE, SECTION_1, SECTION_2, COL_SCALES)
            if ROTATE:
                q = _rotate_halves(q1.to(dtype), q2.to(dtype), HEAD_DIM, DOT_PRECISION)
                tl.store(out_rows + tl.arange(0, HEAD_DIM)[None, :], q.to(dtype), mask=mask[:, None])
            else:
                offs_d = tl.arange(0, HALF_PAD)
                m = mask[:, None] & (offs_d < HEAD_DIM // 2)[None, :]
                tl.store(out_rows + offs_d[None, :], q1.to(dtype), mask=m)
                tl.store(out_rows + HEAD_DIM // 2 + offs_d[None, :], q2.to(dtype), mask=m)
    else:
        offs_r = tl.arange(0, TOKENS * Q_HEADS_PAD)
        tok = (first + offs_r // Q_HEADS_PAD).to(tl.int64)
        head = offs_r % Q_HEADS_PAD
        mask = (head < NUM_Q_HEADS) & (tok < num_rows)
        out_rows = q_out_ptr + (tok * stride_qot + head * stride_qoh)[:, None]
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :], mask=mask[:, None],
                    other=0.0)
        tl.store(out_rows + offs_d[None, :], _rotate_rows(q, HEAD_DIM, DOT_PRECISION).to(dtype), mask=mask[:, None])


@jit_without_specializing("num_slots", "num_rows", "stride_p", "stride_pr")
def _write_kv_fp8_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr, q_ptr, q_out_ptr,
    positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, col_scale_ptr, eps,
    num_slots, num_rows, stride_kt, stride_kh, stride_vt, stride_qt, stride_qh, stride_qot, stride_qoh,
    stride_p, stride_pr, stride_c,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr, NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, TOKENS: tl.constexpr,
    ROTATE: tl.constexpr, QUERIES: tl.constexpr, SPLIT_Q: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
    MROPE: tl.constexpr, SECTION_1: tl.constexpr, SECTION_2: tl.constexpr, COL_SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, Q_CHUNK: tl.constexpr,
):
    """``TOKENS`` tokens' K and V into their FP8 cache slots: each head's row scaled to an absolute maximum of 448
    (float8_e4m3's largest value), its scale stored beside it; with ``ROTATE`` K rotated first. With ``QUERIES`` the
    tokens' queries go to ``q_out`` as the attention kernels must read them (rotated like K with ``ROTATE``), and the
    grid covers q's ``num_rows`` rows; rows past ``num_slots``, and slots < 0, write no cache. The tokens of one
    program share the Hadamard matrix and fill its products' rows, which halved the writes' time in a long
    prefill step (``_write_tokens``; bench/RESULTS.md).

    ``ROPE``: q and k still need their rope (Qwen3's q/k norm first with ``HAS_NORM``; M-RoPE with ``MROPE``), which
    is applied to each row after it is loaded and before it is rotated and quantized, with the rope kernel's
    roundings (``_roped_rows``). ``COL_SCALES``: q|k|v's columns still need their FP8 weights' scales
    (``col_scale_ptr``), applied to each value first: to q, k and v with ``ROPE``, else to V only (q and k were
    scaled with their rope, apart)."""
    first = tl.program_id(0) * TOKENS
    part = tl.program_id(1)  # with SPLIT_Q: 0 writes K and V, 1 the queries
    q_size: tl.constexpr = NUM_Q_HEADS * HEAD_DIM
    kv_size: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    if part == 0:
        if ROPE:
            _store_roped_fp8_rows(k_ptr, stride_kt, stride_kh, k_cache_ptr, k_scale_ptr, slot_mapping_ptr, first,
                                  num_slots, positions_ptr, cos_sin_ptr, k_weight_ptr, col_scale_ptr + q_size, eps,
                                  stride_p, stride_pr, stride_c, NUM_KV_HEADS, HEADS_PAD, HEAD_DIM, HALF_PAD, TOKENS,
                                  ROTATE, HAS_NORM, MROPE, SECTION_1, SECTION_2, COL_SCALES, DOT_PRECISION, INTERPRET)
        else:
            _store_fp8_rows(k_ptr, stride_kt, k_cache_ptr, k_scale_ptr, slot_mapping_ptr, col_scale_ptr, first,
                            num_slots, NUM_KV_HEADS, HEADS_PAD, HEAD_DIM, D_PAD, TOKENS, ROTATE, False, DOT_PRECISION,
                            INTERPRET)
        _store_fp8_rows(v_ptr, stride_vt, v_cache_ptr, v_scale_ptr, slot_mapping_ptr, col_scale_ptr + q_size + kv_size,
                        first, num_slots, NUM_KV_HEADS, HEADS_PAD, HEAD_DIM, D_PAD, TOKENS, False, COL_SCALES,
                        DOT_PRECISION, INTERPRET)
    if QUERIES:
        if part == SPLIT_Q:  # the second row of programs, or (unsplit) the only one
            _store_queries(q_ptr, q_out_ptr, first, num_rows, stride_qt, stride_qh, stride_qot, stride_qoh,
                           positions_ptr, cos_sin_ptr, q_weight_ptr, col_scale_ptr, eps, stride_p, stride_pr, stride_c,
                           NUM_Q_HEADS, Q_HEADS_PAD, HEAD_DIM, HALF_PAD, TOKENS, ROTATE, ROPE, HAS_NORM, MROPE,
                           SECTION_1, SECTION_2, COL_SCALES, DOT_PRECISION, Q_CHUNK)


def _launch_write_fp8(k, v, k_cache, v_cache, slot_mapping, kv_scales, q, q_out, rope, v_column_scales,
                      tokens_per_program=None, split_queries=None) -> None:
    """``_write_kv_fp8_kernel`` on checked arguments, over q's rows where ``q_out`` is given (the queries to rope or
    rotate) and else over the slots'; ``rope``: the rope q and k still need (the kernel ropes them), or
    ``v_column_scales``: q|k|v's column scales, of which V's are left to apply. ``tokens_per_program`` and
    ``split_queries`` replace ``_write_tokens``'s and ``_splits_queries``'s choices, for sweeps."""
    if tokens_per_program not in (None, 1, 2, 4, 8, 16):
        raise ValueError(f"tokens_per_program must be a power of two up to 16, got {tokens_per_program!r}")
    num_tokens = slot_mapping.shape[0]
    queries = q_out is not None
    rows = q.shape[0] if queries else num_tokens
    if rows == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    rotate = rotates_keys(head_dim)
    tokens = tokens_per_program or _write_tokens(rows)
    min_rows = 16 // tokens if rotate else 1  # tl.dot takes 16 rows or more
    q_heads = q.shape[1] if q is not None else 1  # with column scales it places k's and v's
    split_q = queries and (split_queries if split_queries is not None else _splits_queries(rows))
    placeholder = q if queries else k  # for the pointers a variant does not read
    if rope is not None:
        stride_p, stride_pr, section_1, section_2 = rope_strides(rope.positions, rope.mrope_section)
        has_norm, column_scales = rope.q_weight is not None, rope.column_scales
        rope_args = (rope.positions, rope.cos_sin_cache, rope.q_weight if has_norm else placeholder,
                     rope.k_weight if has_norm else placeholder,
                     column_scales if column_scales is not None else placeholder, float(rope.eps))
        rope_strides_args = (stride_p, stride_pr, rope.cos_sin_cache.stride(0))
    else:  # V's column scales, where the queries and K were scaled and roped apart
        section_1 = section_2 = 0
        has_norm, column_scales = False, v_column_scales
        rope_args = (slot_mapping, placeholder, placeholder, placeholder,
                     column_scales if column_scales is not None else placeholder, 0.0)
        rope_strides_args = (0, 0, 0)
    q_heads_pad = max(next_power_of_2(q_heads), 16 // tokens)
    _write_kv_fp8_kernel[(cdiv(rows, tokens), 2 if split_q else 1)](
        k, v, k_cache, v_cache, kv_scales[0], kv_scales[1], slot_mapping, placeholder,
        q_out if queries else k, *rope_args, num_tokens, rows, k.stride(0), k.stride(1), v.stride(0),
        *(q.stride()[:2] if queries else (0, 0)), *(q_out.stride()[:2] if queries else (0, 0)),
        *rope_strides_args,
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=max(next_power_of_2(num_kv_heads), min_rows),
        HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim),
        HALF_PAD=next_power_of_2(max(head_dim // 2, 1)), NUM_Q_HEADS=q_heads,
        Q_HEADS_PAD=q_heads_pad, TOKENS=tokens, ROTATE=rotate,
        QUERIES=queries, SPLIT_Q=split_q, ROPE=rope is not None, HAS_NORM=has_norm,
        MROPE=rope is not None and rope.mrope_section is not None, SECTION_1=section_1, SECTION_2=section_2,
        COL_SCALES=column_scales is not None, DOT_PRECISION=_dot_precision(k.dtype), INTERPRET=interpreted(),
        Q_CHUNK=min(q_heads_pad, max(32 // tokens, 1)) if rope is not None else q_heads_pad,
        num_warps=4, enable_fp_fusion=False,
    )
