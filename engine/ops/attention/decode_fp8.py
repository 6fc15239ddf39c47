"""Decode attention on an FP8 cache, read as 16-bit words: each tile is two half-width tiles.

K and V tiles are loaded as 16-bit words, each the values of two neighbouring head dimensions, and
converted to two [BLOCK_N, HEAD_DIM // 2] tiles; the scores are ``q_a @ k_a^T + q_b @ k_b^T`` with the
queries' dimensions split alike, and the output's two halves accumulate apart, so nothing is interleaved
in registers. Loaded this way the tiles take Triton's 16-bit shared-memory path (ldmatrix) rather than
byte loads and shuffles, faster than converting whole tiles to float16 or bfloat16 (bench/RESULTS.md).

* The dots run in ``DOT_DTYPE``: float16 for 16-bit queries (float8_e4m3 converts to it natively, to
  bfloat16 it does not), float32 for float32 ones. ``PTX`` converts in inline PTX (``_fp8_bytes_to``),
  faster than Triton's conversion; V's halves are then its even and odd dimensions.
* ``K_PAIRS`` converts K without byte permutes (``_fp8_word_pairs_to_f16``): its halves are dimensions
  4i, 4i + 1 and 4i + 2, 4i + 3. Otherwise K's halves are the even and odd dimensions, as V's.
* A key's scale multiplies its column of the scores. A value's scale multiplies its column of ``p``,
  lifted by ``V_LIFT`` = 2^8 (undone with the normalization), so that small probabilities times small
  scales stay out of float16's subnormals: a product below 2^-14 needs ``p`` under 2^-22 / scale, a key
  whose term ``p * v`` is under 448 * 2^-22 (~1.1e-4), and even it keeps a subnormal's precision. V's
  largest magnitude may reach 448 * 65504 / 2^8 (~115k), queries' 65504.
* K is loaded without masks: a position past the context reads a slot of its block or of block 0 (the
  block table's padding), and its score is masked. V is masked: stale values times ``p`` = 0 could be NaN.
* ``KV_HEADS`` neighbouring KV heads per program, their query heads stacked in the rows (GROUP * KV_HEADS <=
  GROUP_PAD): the dots pad the rows to 16 whatever their number, so with 4 query heads a KV head two KV heads
  fill 8 of them and the softmax's work per useful row halves. Each KV head's scores are computed for all
  rows and kept in its own; each KV head's V is multiplied by ``p`` with the other rows zeroed
  (``launch._decode_kv_heads`` says where it pays).
* ``HEADS_FIRST``: the grid's first axis runs over the KV heads, so the programs of one row's heads are
  scheduled side by side and share the 32-byte sectors of their keys' scales (one float32 per token and head,
  heads innermost) and the cache pages they read: faster unsplit, where few rows in many splits were faster
  rows first.

Scaling ``p`` rather than V's rows and converting K without byte permutes shortens the loop by a fifth
(bench/RESULTS.md has the instruction counts and times behind each choice here).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.ops.attention.tiles import _soft_cap, _split_range, _store_decode_lse, _store_decode_rows, _tile_blocks
from engine.ops.triton_helpers import jit_without_specializing


@triton.jit
def _fp8_bytes_to(words, HIGH: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr):
    """The float8_e4m3 values in the low (``HIGH`` false) or the high bytes of 16-bit words, in DOT_DTYPE.

    ``PTX`` (float16 on sm_89 and later): two words at a time, one byte permute gathers their low or high
    bytes and one packed conversion turns them into a float16 pair, which is what the tensor cores take.
    Triton's own conversion, the other path, unpacks each byte and packs it again, which lengthens the decode
    kernel's loop by about a third (PTX instruction counts in bench/RESULTS.md).
    """
    if PTX:
        SELECT: tl.constexpr = 0x31 if HIGH else 0x20  # prmt's byte selector: bytes 1 and 3, or 0 and 2
        return tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t;
            .reg .b16 l, h;
            prmt.b32 t, $1, 0, {SELECT};
            mov.b32 {{l, h}}, t;
            cvt.rn.f16x2.e4m3x2 $0, l;
            }}""", constraints="=r,r", args=[words], dtype=tl.float16, is_pure=True, pack=2)
    byte = (words >> 8) & 0xFF if HIGH else words & 0xFF
    return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)


@triton.jit
def _fp8_word_pairs_to_f16(words):
    """K's [BLOCK_N, HEAD_DIM // 2] 16-bit words as two float16 tiles, without a byte permute: the register that
    holds words 2i and 2i + 1 (dimensions 4i to 4i + 3) becomes the pair (4i, 4i + 1) of the first tile and the
    pair (4i + 2, 4i + 3) of the second, one conversion each. Not elementwise: it relies on the layout of K as
    a dot operand, which packs consecutive words of one key into a register (Triton 3.x, ``kWidth`` 2 along
    the head dimension); ``_word_pairs_hold`` checks that on the device before the kernel uses it."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 l, h;
        mov.b32 {l, h}, $2;
        cvt.rn.f16x2.e4m3x2 $0, l;
        cvt.rn.f16x2.e4m3x2 $1, h;
        }""", constraints="=r,=r,r", args=[words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _fp8_query_halves(q_ptr, seq, heads, head_mask, stride_qb, stride_qh, HALF: tl.constexpr, K_PAIRS: tl.constexpr,
                      DOT_DTYPE: tl.constexpr):
    """The program's query rows [GROUP_PAD, HALF] as the two halves K's tiles come in, in ``DOT_DTYPE``."""
    offs_j = tl.arange(0, HALF)
    if K_PAIRS:  # K's halves as _fp8_word_pairs_to_f16 makes them: dimensions 4i, 4i + 1 and 4i + 2, 4i + 3
        dims_a = 4 * (offs_j // 2) + offs_j % 2
        dims_b = dims_a + 2
    else:  # even and odd dimensions
        dims_a = 2 * offs_j
        dims_b = dims_a + 1
    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
    q_a = tl.load(q_rows + dims_a[None, :], mask=head_mask[:, None], other=0.0).to(DOT_DTYPE)  # [GROUP_PAD, HALF]
    q_b = tl.load(q_rows + dims_b[None, :], mask=head_mask[:, None], other=0.0).to(DOT_DTYPE)
    return q_a, q_b


@triton.jit
def _fp8_tile_scores(k_words, k_rows, k_scale_ptr, scale_rows, valid, q_a, q_b, qk_scale, row_kv_head, offs_j,
                     stride_kh, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, KV_HEADS: tl.constexpr,
                     K_PAIRS: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The scores [GROUP_PAD, BLOCK_N] of one key tile, each row's from its own KV head's keys, times ``qk_scale``
    and each key's scale. K is read unmasked: a key past the end reads some slot of its block or of block 0, and
    its score is masked by the caller."""
    s = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
    for h in tl.static_range(KV_HEADS):
        k_w = tl.load(k_words + (k_rows + h * stride_kh)[:, None] + offs_j[None, :])
        if K_PAIRS:
            k_a, k_b = _fp8_word_pairs_to_f16(k_w)
        else:
            k_a, k_b = _fp8_bytes_to(k_w, False, DOT_DTYPE, PTX), _fp8_bytes_to(k_w, True, DOT_DTYPE, PTX)
        s_h = (tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PRECISION)
               + tl.dot(q_b, tl.trans(k_b), input_precision=DOT_PRECISION))  # [GROUP_PAD, BLOCK_N]
        s_h = s_h * (qk_scale * tl.load(k_scale_ptr + scale_rows + h, mask=valid, other=0.0))[None, :]
        s = s_h if KV_HEADS == 1 else tl.where((row_kv_head == h)[:, None], s_h, s)
    return s


@triton.jit
def _fp8_tile_values(v_words, v_rows, v_scale_ptr, scale_rows, valid, p, row_kv_head, offs_j, stride_vh, acc_even,
                     acc_odd, V_LIFT: tl.constexpr, KV_HEADS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     PTX: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc_even`` and ``acc_odd`` plus one value tile's products with ``p``, each key's column of ``p`` times its
    V scale lifted by ``V_LIFT``, each row's from its own KV head's values."""
    for h in tl.static_range(KV_HEADS):
        v_scales = tl.load(v_scale_ptr + scale_rows + h, mask=valid, other=0.0)
        v_w = tl.load(v_words + (v_rows + h * stride_vh)[:, None] + offs_j[None, :], mask=valid[:, None],
                      other=0)
        v_lo, v_hi = _fp8_bytes_to(v_w, False, DOT_DTYPE, PTX), _fp8_bytes_to(v_w, True, DOT_DTYPE, PTX)
        p_h = p * (v_scales * V_LIFT)[None, :]  # each key's V scale, lifted by 2^8 (the module docstring)
        if KV_HEADS > 1:
            p_h = tl.where((row_kv_head == h)[:, None], p_h, 0.0)
        p_h = p_h.to(DOT_DTYPE)
        acc_even += tl.dot(p_h, v_lo, input_precision=DOT_PRECISION)
        acc_odd += tl.dot(p_h, v_hi, input_precision=DOT_PRECISION)
    return acc_even, acc_odd


@jit_without_specializing("block_tables_ptr", "seq_lens_ptr", "max_context_len", "window")
def _decode_split_fp8_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, max_context_len, window, softcap,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PTX: tl.constexpr, K_PAIRS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    """One split of one row's context for ``KV_HEADS`` KV heads (the module docstring has the design); the cache
    strides arrive in 16-bit words (the launch halves them; HEAD_DIM is even)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    V_LIFT: tl.constexpr = 256.0
    seq = tl.program_id(1 if HEADS_FIRST else 0)
    kv_head = tl.program_id(0 if HEADS_FIRST else 1) * KV_HEADS  # the program's first KV head
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_j = tl.arange(0, HALF)  # word j holds dimensions 2j (low byte) and 2j + 1 (high byte)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    head_mask = offs_g < GROUP * KV_HEADS
    row_kv_head = offs_g // GROUP  # which of the program's KV heads each row's query head reads

    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_context_len)
    first_key, start, end = _split_range(seq_len, window, split, SLIDING, PAGE_SIZE, BLOCK_N, NUM_SPLITS)

    q_a, q_b = _fp8_query_halves(q_ptr, seq, heads, head_mask, stride_qb, stride_qh, HALF, K_PAIRS, DOT_DTYPE)
    k_words = k_cache_ptr.to(tl.pointer_type(tl.int16))
    v_words = v_cache_ptr.to(tl.pointer_type(tl.int16))
    table_ptr = block_tables_ptr + seq * stride_bt
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc_even = tl.zeros([GROUP_PAD, HALF], tl.float32)
    acc_odd = tl.zeros([GROUP_PAD, HALF], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        valid = (pos < end) & (pos >= first_key)
        block_ids, in_block = _tile_blocks(table_ptr, tile_start, end, offs_n, PAGE_SIZE, BLOCK_N)
        k_rows = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh
        scale_rows = block_ids * stride_sb + in_block * stride_ss + kv_head
        s = _fp8_tile_scores(k_words, k_rows, k_scale_ptr, scale_rows, valid, q_a, q_b, qk_scale, row_kv_head, offs_j,
                             stride_kh, GROUP_PAD, BLOCK_N, KV_HEADS, K_PAIRS, DOT_DTYPE, PTX, DOT_PRECISION)
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc_even = acc_even * alpha[:, None]
        acc_odd = acc_odd * alpha[:, None]
        v_rows = block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh
        acc_even, acc_odd = _fp8_tile_values(v_words, v_rows, v_scale_ptr, scale_rows, valid, p, row_kv_head, offs_j,
                                             stride_vh, acc_even, acc_odd, V_LIFT, KV_HEADS, DOT_DTYPE, PTX,
                                             DOT_PRECISION)
        m_i = m_new

    inv_l = 1.0 / (V_LIFT * tl.where(l_i > 0, l_i, 1.0))  # an empty range gives zeros, never NaN
    _store_decode_rows(acc_even * inv_l[:, None], 2 * offs_j, seq, split, heads, head_mask, out_ptr, part_out_ptr,
                       stride_ob, stride_oh, NUM_HEADS, HEAD_DIM, NUM_SPLITS)
    _store_decode_rows(acc_odd * inv_l[:, None], 2 * offs_j + 1, seq, split, heads, head_mask, out_ptr,
                       part_out_ptr, stride_ob, stride_oh, NUM_HEADS, HEAD_DIM, NUM_SPLITS)
    _store_decode_lse(m_i, l_i, seq, split, heads, head_mask, part_lse_ptr, NUM_HEADS, NUM_SPLITS)
