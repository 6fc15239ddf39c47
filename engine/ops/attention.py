"""Paged attention kernels in Triton, each with a Python wrapper that checks its inputs.

Both kernels read K/V in place through the block table; nothing is gathered into
contiguous tensors. A key tile of ``BLOCK_N`` positions may span several cache
blocks; tiles start on block boundaries, so each block's id is loaded once per tile
and serves its keys' K, V (and FP8 scales)::

    position p  ->  block_tables[seq, p // block_size] * block_size + p % block_size

Both are GQA-aware: one program owns one KV head and all the query heads that share
it, so each K/V tile is loaded once per group rather than once per query head.

* ``paged_decode_attention``: one query token per sequence, flash-decoding. The
  context is cut into ``num_splits`` pieces that run in parallel (grid
  ``(num_seqs, num_kv_heads, num_splits)``); each writes a partial output and its
  log-sum-exp, and a small second kernel merges them.
* ``paged_prefill_attention``: a varlen batch of new tokens (prefill, chunked
  prefill, decode rows too) attending causally to their cached context and to
  themselves. Query tokens of one request are packed with their query heads into
  row tiles (grid ``(query tiles, num_kv_heads)``). It is correct for decode rows too,
  but slower there than the decode kernel (it cannot split small batches, and decode rows
  batched with long prompts get their tile size), so the backend uses both.

Measurements behind the launch choices: bench/RESULTS.md (its section "Kernel measurements moved from
docstrings" quotes those that stood in these docstrings).

CUDA-graph safety: grids and compile-time constants depend only on tensor shapes
and host arguments. Sequence lengths are read on the device, so a captured launch
stays correct when the lengths change between replays.

Softmax runs in base 2 (``exp2``), with the scale folded into ``qk_scale``.
Everything accumulates in float32.

FP8 caches (``kv_scales`` given, see ``kvcache.paged_cache``): K and V tiles are loaded as
float8_e4m3 and converted in registers, with their per-(token, head) scales; a key's scale
multiplies its column of ``q @ k^T``. The decode kernel has its own FP8 variant, which reads the
tiles as byte pairs (``_decode_split_fp8_kernel`` says why); the prefill kernel converts whole tiles
and scales V's rows by their scales. The write kernel quantizes each head's row.

The KV-cache write (``write_paged_kv``) also prepares the queries: given the
layer's pending rope (``engine.models.layers.PendingRope``), q and k arrive as the q|k|v projection left them
and the launch applies their rope (after Qwen3's per-head norm; M-RoPE too; an FP8 product's column scales
first), stores K roped in its slot and returns q roped. On a 16-bit cache that is one launch of the rope
kernel (``fused_ops.rotary_into_cache``): one program per token for q, one for K and V. On an FP8 cache the rope
kernel runs first (with q's and k's column scales) and ``_write_kv_fp8_kernel`` follows (V's scales), which
measured faster than that kernel roping K's and the queries' rows itself (``fuse_rope``; engaged up to
``_FP8_FUSED_ROPE_MAX_ROWS`` rows, none for now). The roundings are those of the separate rope kernel followed by
the plain write.
"""

from __future__ import annotations

import functools
import inspect
import math
import os

import torch
import triton
import triton.language as tl

from engine.ops.fused import (
    _norm_halves,
    _rope_halves,
    _round,
    check_rope_inputs,
    rotary_into_cache,
    rotary_with_column_scales,
)
from engine.ops.intmath import cdiv, next_power_of_2
from kvcache.paged_cache import FP8_DTYPE, rotates_keys

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
MAX_NUM_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 64  # one key tile: measured on an H200, splits this short still paid off
LOG2_E = 1.4426950408889634
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second (and third) axis
# Up to this many rows an FP8 cache's write ropes q and k itself; past it the rope kernel runs first (write_paged_kv).
# The fused launch measured slower from 2,048 tokens on and no faster at 256 (bench/kv_write.py; bench/RESULTS.md):
# rope runs apart until decode sizes are tuned.
_FP8_FUSED_ROPE_MAX_ROWS = 0


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_page_ids(table_ptr, tile_start, end, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block-table entries of the key tile at ``tile_start`` (int32, 0 past ``end``): one per block when a tile
    spans whole blocks (``BLOCK_N`` a multiple of the block size; the decode kernels start every tile on a block
    boundary), else one per key. ``_tile_rows`` turns them into the keys' rows.

    Each block id is loaded once and broadcast to its keys, not once per key, which shortens both decode kernels
    (bench/RESULTS.md).
    """
    if BLOCK_N % PAGE_SIZE == 0:
        PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
        offs_p = tl.arange(0, PAGES)
        ids = tl.load(table_ptr + tile_start // PAGE_SIZE + offs_p, mask=tile_start + offs_p * PAGE_SIZE < end,
                      other=0)
    else:
        pos = tile_start + tl.arange(0, BLOCK_N)
        ids = tl.load(table_ptr + pos // PAGE_SIZE, mask=pos < end, other=0)
    return ids


@triton.jit
def _tile_rows(ids, tile_start, offs_n, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(block ids [BLOCK_N] int64, offsets within the block [BLOCK_N]) of positions ``tile_start + offs_n``, from
    ``_tile_page_ids``'s entries."""
    if BLOCK_N % PAGE_SIZE == 0:
        PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
        rows = tl.reshape(tl.broadcast_to(ids.to(tl.int64)[:, None], (PAGES, PAGE_SIZE)), (BLOCK_N,))
        in_block = offs_n % PAGE_SIZE
    else:
        rows = ids.to(tl.int64)
        in_block = (tile_start + offs_n) % PAGE_SIZE
    return rows, in_block


@triton.jit
def _tile_blocks(table_ptr, tile_start, end, offs_n, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(block ids [BLOCK_N] int64, offsets within the block [BLOCK_N]) of positions ``tile_start + offs_n``; ids
    past ``end`` read as 0."""
    return _tile_rows(_tile_page_ids(table_ptr, tile_start, end, PAGE_SIZE, BLOCK_N), tile_start, offs_n,
                      PAGE_SIZE, BLOCK_N)


@triton.jit
def _soft_cap(s, softcap):
    """``softcap * tanh(s / softcap)`` in base 2: ``s`` arrives in natural units and leaves multiplied by log2(e)."""
    return softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * 1.4426950408889634


def _jit_without_specializing(*names: str):
    """``triton.jit`` that compiles one variant whatever values these arguments take from step to step.

    Triton otherwise specializes ints on being 1 or a multiple of 16 and pointers on 16-byte alignment;
    a slice such as ``seq_lens[d:]`` is aligned or not depending on the number of decodes ``d``, so a
    running server would compile new variants mid-run. Only scalar loads go through these arguments.
    """
    kwargs = {"do_not_specialize": list(names)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = list(names)
    return triton.jit(**kwargs)


@triton.jit
def _split_range(seq_len, window, split, SLIDING: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 NUM_SPLITS: tl.constexpr):
    """(first key, start, end) of this split's keys: each split owns a whole number of key tiles, and
    tiles start on block boundaries (a window's first key is masked, not the tile's start moved);
    trailing splits may be empty (seq_len 0: all are)."""
    first_key = 0
    if SLIDING:  # only the last ``window`` keys: the blocks before them are never read
        first_key = tl.maximum(seq_len - window, 0)
    kv_start = (first_key // PAGE_SIZE) * PAGE_SIZE
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - kv_start, BLOCK_N), NUM_SPLITS)
    start = kv_start + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    return first_key, start, end


@triton.jit
def _store_decode_rows(o, cols, seq, split, heads, head_mask, out_ptr, part_out_ptr, stride_ob, stride_oh,
                       NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Normalized output rows ``o`` [GROUP_PAD, C] at head-dim columns ``cols``: into ``out`` when the context
    is not split, else into the split's workspace row (part_out [num_seqs, NUM_HEADS, NUM_SPLITS, HEAD_DIM])."""
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + cols[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + cols[None, :], o, mask=head_mask[:, None])


@triton.jit
def _store_decode_lse(m_i, l_i, seq, split, heads, head_mask, part_lse_ptr, NUM_HEADS: tl.constexpr,
                      NUM_SPLITS: tl.constexpr):
    """A split's log-sum-exp (part_lse [num_seqs, NUM_HEADS, NUM_SPLITS]; -inf for an empty split) for the merge."""
    if NUM_SPLITS > 1:
        has_keys = l_i > 0
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + (seq * NUM_HEADS + heads) * NUM_SPLITS + split, lse, mask=head_mask)


@_jit_without_specializing("block_tables_ptr", "seq_lens_ptr", "max_context_len", "window")
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, max_context_len, window, softcap,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Decode attention on a cache in the query's dtype (the scale pointers and strides are unused)."""
    seq = tl.program_id(0)  # rows come longest context first, so that short ones fill the tail
    kv_head = tl.program_id(1)
    split = tl.program_id(2) if NUM_SPLITS > 1 else 0  # a constant when unsplit: the first tile starts at key 0
    offs_g = tl.arange(0, GROUP_PAD)  # query heads of this KV head, padded for tl.dot
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    head_mask = offs_g < GROUP

    # The clamp keeps a bad length from reading past the block table's row.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_context_len)
    first_key, start, end = _split_range(seq_len, window, split, SLIDING, PAGE_SIZE, BLOCK_N, NUM_SPLITS)

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    table_ptr = block_tables_ptr + seq * stride_bt
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # A tile's block ids are loaded one tile ahead: K and V's addresses then depend on no load of their own
    # iteration, and Triton's pipeliner gives them num_stages - 1 buffers (with the ids loaded in the loop it gave
    # them one whatever the stages). _decode_tiles says which count pays.
    # Unsplit without a window the first tile starts at key 0, so its block ids are read within the table's row
    # rather than up to the context's end: their load need not wait for the row's length, only for the row.
    # (Ids past the end name blocks whose keys the loop masks, never read.)
    first_ids_end = max_context_len if NUM_SPLITS == 1 and not SLIDING else end
    page_ids = _tile_page_ids(table_ptr, start, first_ids_end, PAGE_SIZE, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        valid = (pos < end) & (pos >= first_key)  # every tile holds a valid key: m_i turns finite at once
        block_ids, in_block = _tile_rows(page_ids, tile_start, offs_n, PAGE_SIZE, BLOCK_N)
        page_ids = _tile_page_ids(table_ptr, tile_start + BLOCK_N, end, PAGE_SIZE, BLOCK_N)
        k_rows = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty range gives zeros, never NaN
    _store_decode_rows(o, offs_d, seq, split, heads, head_mask, out_ptr, part_out_ptr, stride_ob, stride_oh,
                       NUM_HEADS, HEAD_DIM, NUM_SPLITS)
    _store_decode_lse(m_i, l_i, seq, split, heads, head_mask, part_lse_ptr, NUM_HEADS, NUM_SPLITS)


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


@_jit_without_specializing("block_tables_ptr", "seq_lens_ptr", "max_context_len", "window")
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
      (``_decode_kv_heads`` says where it pays).
    * ``HEADS_FIRST``: the grid's first axis runs over the KV heads, so the programs of one row's heads are
      scheduled side by side and share the 32-byte sectors of their keys' scales (one float32 per token and head,
      heads innermost) and the cache pages they read: faster unsplit, where few rows in many splits were faster
      rows first.

    Scaling ``p`` rather than V's rows and converting K without byte permutes shortens the loop by a fifth
    (bench/RESULTS.md has the instruction counts and times behind each choice here).
    """
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

    if K_PAIRS:  # K's halves as _fp8_word_pairs_to_f16 makes them: dimensions 4i, 4i + 1 and 4i + 2, 4i + 3
        dims_a = 4 * (offs_j // 2) + offs_j % 2
        dims_b = dims_a + 2
    else:  # even and odd dimensions
        dims_a = 2 * offs_j
        dims_b = dims_a + 1
    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
    q_a = tl.load(q_rows + dims_a[None, :], mask=head_mask[:, None], other=0.0).to(DOT_DTYPE)  # [GROUP_PAD, HALF]
    q_b = tl.load(q_rows + dims_b[None, :], mask=head_mask[:, None], other=0.0).to(DOT_DTYPE)
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
        # The cache strides arrive in 16-bit words (the wrapper halves them; HEAD_DIM is even). K is read
        # unmasked: a key past the end reads some slot of its block or of block 0, and its score is masked.
        k_rows = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh
        scale_rows = block_ids * stride_sb + in_block * stride_ss + kv_head
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
        for h in tl.static_range(KV_HEADS):
            v_scales = tl.load(v_scale_ptr + scale_rows + h, mask=valid, other=0.0)
            v_w = tl.load(v_words + (v_rows + h * stride_vh)[:, None] + offs_j[None, :], mask=valid[:, None],
                          other=0)
            v_lo, v_hi = _fp8_bytes_to(v_w, False, DOT_DTYPE, PTX), _fp8_bytes_to(v_w, True, DOT_DTYPE, PTX)
            p_h = p * (v_scales * V_LIFT)[None, :]  # each key's V scale, lifted by 2^8 (docstring)
            if KV_HEADS > 1:
                p_h = tl.where((row_kv_head == h)[:, None], p_h, 0.0)
            p_h = p_h.to(DOT_DTYPE)
            acc_even += tl.dot(p_h, v_lo, input_precision=DOT_PRECISION)
            acc_odd += tl.dot(p_h, v_hi, input_precision=DOT_PRECISION)
        m_i = m_new

    inv_l = 1.0 / (V_LIFT * tl.where(l_i > 0, l_i, 1.0))  # an empty range gives zeros, never NaN
    _store_decode_rows(acc_even * inv_l[:, None], 2 * offs_j, seq, split, heads, head_mask, out_ptr, part_out_ptr,
                       stride_ob, stride_oh, NUM_HEADS, HEAD_DIM, NUM_SPLITS)
    _store_decode_rows(acc_odd * inv_l[:, None], 2 * offs_j + 1, seq, split, heads, head_mask, out_ptr,
                       part_out_ptr, stride_ob, stride_oh, NUM_HEADS, HEAD_DIM, NUM_SPLITS)
    _store_decode_lse(m_i, l_i, seq, split, heads, head_mask, part_lse_ptr, NUM_HEADS, NUM_SPLITS)


@_jit_without_specializing("stride_fs")
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, fp8_values_ptr, fp8_scales_ptr, stride_ob, stride_oh,
    stride_fv, stride_fs, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, FP8_OUT: tl.constexpr,
):
    """One head of one row: the splits' partial outputs weighted by their log-sum-exps. ``FP8_OUT``: the row
    quantized as an FP8 projection's input instead (``paged_decode_attention``'s ``fp8_out``): rounded to the
    model dtype, then its absolute maximum mapped to 448, ``fp8_kernels.quantize_rows``'s arithmetic."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    split_mask = offs_s < NUM_SPLITS
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=split_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0): weights 0, output 0
    w = tl.exp2(lse - m)  # [SPLITS_PAD], 0 for empty splits
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=split_mask[:, None], other=0.0)
    denom = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
    if FP8_OUT:
        res = res.to(out_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(res), 0) / 448.0, 1.1754943508222875e-38)
        tl.store(fp8_values_ptr + seq * stride_fv + head * HEAD_DIM + offs_d,
                 (res / scale).to(fp8_values_ptr.dtype.element_ty))
        tl.store(fp8_scales_ptr + seq + head * stride_fs, scale)
    else:
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_kt, stride_vt,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr,
):
    """One token's K and V rows (num_kv_heads * head_dim each) into its cache slot; slot < 0 skips."""
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = (offs < ROW) & (slot >= 0)
    k = tl.load(k_ptr + tok * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


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
    them (``engine.ops.fused._rope_kernel``, the same roundings): times their columns' scales with
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
        x1 = _round(x1 * tl.load(scale_ptrs, mask=m, other=0.0), x_ptr)
        x2 = _round(x2 * tl.load(scale_ptrs + half, mask=m, other=0.0), x_ptr)
    if HAS_NORM:
        w1 = tl.load(weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x1, x2 = _norm_halves(x1, x2, w1, w2, eps, x_ptr, HEAD_DIM)
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
    cos = _round(tl.load(table, mask=m, other=0.0), x_ptr)  # rounded to the activation dtype, as torch does
    sin = _round(tl.load(table + half, mask=m, other=0.0), x_ptr)
    o1, o2 = _rope_halves(x1, x2, cos, sin, x_ptr)
    return _round(o1, x_ptr), _round(o2, x_ptr)


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


@_jit_without_specializing("num_slots", "num_rows", "stride_p", "stride_pr")
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


@triton.jit
def _find_request(query_start_loc_ptr, q_base, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """Binary search for the request that owns query tile ``tile``.

    Request i owns tiles ``[first(i), first(i + 1))`` with ``first(i) = q_start(i) // BLOCK_Q + i``:
    at least ``cdiv(query_len(i), BLOCK_Q)`` tiles each, ``num_tokens // BLOCK_Q + num_reqs`` in all,
    strictly increasing. Invariant: first(lo) <= tile < first(hi).
    """
    lo = num_reqs * 0  # a runtime int32 like hi, so both loop variables keep one type
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = (tl.load(query_start_loc_ptr + mid) - q_base) // BLOCK_Q + mid
        is_before = first <= tile
        lo = tl.where(is_before, mid, lo)
        hi = tl.where(is_before, hi, mid)
    return lo


@triton.jit
def _prefill_tile(tile_start, kv_end, offs_n, offs_d, table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                  q, q_pos, m_i, l_i, acc, qk_scale, softcap, window, kv_head,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  SLIDING: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  MASKED: tl.constexpr):
    """One key tile of ``_prefill_kernel``: the running (max, sum, output) of its rows updated. ``MASKED`` for a
    tile some row must not see all of (causality, a window, keys past ``kv_end``)."""
    pos = tile_start + offs_n
    valid = pos < kv_end
    # Tiles start on block boundaries: one block-table load per block, shared by K, V and their scales.
    block_ids, in_block = _tile_blocks(table_ptr, tile_start, kv_end, offs_n, PAGE_SIZE, BLOCK_N)
    k_rows = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh
    v_rows = block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh
    scale_rows = block_ids * stride_sb + in_block * stride_ss + kv_head
    if MASKED:
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :])
    if FP8:
        k = k.to(DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if FP8:
        if MASKED:
            s = s * tl.load(k_scale_ptr + scale_rows, mask=valid, other=0.0)[None, :]
        else:
            s = s * tl.load(k_scale_ptr + scale_rows)[None, :]
    if SOFTCAP:
        s = _soft_cap(s, softcap)
    if MASKED:
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SLIDING:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :])
    if FP8:
        if MASKED:
            v_scales = tl.load(v_scale_ptr + scale_rows, mask=valid, other=0.0)
        else:
            v_scales = tl.load(v_scale_ptr + scale_rows)
        v = v.to(DOT_DTYPE) * v_scales[:, None].to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@_jit_without_specializing("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr", "num_reqs", "max_context_len",
                           "window")
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,
    qk_scale, num_reqs, max_context_len, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    HEADS_FIRST: tl.constexpr, SKIP_SINGLE: tl.constexpr,
):
    """Prefill attention; the dots run in ``DOT_DTYPE``: q's dtype, or float16 for 16-bit queries on an FP8
    cache (float8_e4m3 converts to float16 in one instruction, to bfloat16 in three), with V's scales on its rows
    as in the decode kernel. ``HEADS_FIRST``: the grid's first axis runs over the KV heads, so the heads of one
    tile of tokens are scheduled side by side and read the same cache pages (faster on both caches;
    bench/RESULTS.md). ``SKIP_SINGLE``: requests of one new token are left alone (the decode kernel serves
    them)."""
    tile = tl.program_id(1 if HEADS_FIRST else 0)
    kv_head = tl.program_id(0 if HEADS_FIRST else 1)
    q_base = tl.load(query_start_loc_ptr)  # offsets are relative to the first entry
    req = _find_request(query_start_loc_ptr, q_base, tile, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req) - q_base
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_base - q_start
    first_tok = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q  # this tile's first token within the request
    live = first_tok < q_len  # spare tiles past the request's tokens do nothing
    if SKIP_SINGLE:
        live = live & (q_len > 1)
    if live:
        seq_len = tl.load(seq_lens_ptr + req)
        ctx_len = seq_len - q_len  # tokens cached before this step's

        # Row r of the tile is token r // GROUP of the tile, query head r % GROUP of this KV head.
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        tok = first_tok + offs_m // GROUP
        heads = kv_head * GROUP + offs_m % GROUP
        row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM]
        q_pos = ctx_len + tok  # masked rows get positions past the tile: harmless, never stored

        # Keys up to the tile's last query position; the clamp keeps reads inside the table's row.
        kv_end = tl.minimum(ctx_len + tl.minimum(q_len, first_tok + BLOCK_Q), max_context_len)
        table_ptr = block_tables_ptr + req * stride_bt
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv_lo = 0
        if SLIDING:  # from the block of the first key the tile's earliest query still sees; earlier blocks
            # are never read, and the keys of that block before it are masked like any outside the window
            kv_lo = (tl.maximum(ctx_len + first_tok - window + 1, 0) // PAGE_SIZE) * PAGE_SIZE
        # Without a window key 0 is visible to every row, so the first tile makes every m_i finite; with
        # one a row may see nothing in a tile, which the guard below keeps from turning into NaN.
        # Tiles that end by the tile's first query position are seen whole by every row: no masks there.
        # The rest (the diagonal, the end, and every tile under a window) are masked.
        open_end = kv_lo
        if not SLIDING:
            open_end = (tl.minimum(ctx_len + first_tok + 1, kv_end) // BLOCK_N) * BLOCK_N
        for tile_start in range(kv_lo, open_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                tile_start, kv_end, offs_n, offs_d, table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                q, q_pos, m_i, l_i, acc, qk_scale, softcap, window, kv_head,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
                PAGE_SIZE, BLOCK_N, DOT_PRECISION, SLIDING, FP8, SOFTCAP, DOT_DTYPE, False)
        for tile_start in range(open_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                tile_start, kv_end, offs_n, offs_d, table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                q, q_pos, m_i, l_i, acc, qk_scale, softcap, window, kv_head,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
                PAGE_SIZE, BLOCK_N, DOT_PRECISION, SLIDING, FP8, SOFTCAP, DOT_DTYPE, True)

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


# --------------------------------------------------------------------------------------------
# Launch choices
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (an H200's 132 where there is no GPU, e.g. in the interpreter)."""
    if device.type != "cuda":
        return 132
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=4096)
def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int = 132) -> int:
    """How many pieces to cut each context into so that a small decode batch still fills the GPU.

    One piece per (sequence, KV head) program when there are already about two programs per SM;
    otherwise enough pieces for that, but about ``MIN_TOKENS_PER_SPLIT`` keys each at the least,
    rounded up to a power of two so that few variants get compiled. Pieces past a short context
    are empty and cheap. Under a CUDA graph, pass a bound fixed by shapes (the block table's capacity).
    """
    num_programs = max(num_seqs * num_kv_heads, 1)
    if num_programs >= 2 * sm_count:
        return 1
    wanted = cdiv(2 * sm_count, num_programs)
    useful = max(max_context_len // MIN_TOKENS_PER_SPLIT, 1)
    return min(next_power_of_2(min(wanted, useful)), MAX_NUM_SPLITS)


def _decode_tiles(head_dim: int, num_splits: int, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N keys, num_warps, num_stages) of the decode kernel.

    From sweeps (bench/attention_kernels.py --mixed-sweep, bench/fp8_attention_sweep.py; the times are in
    bench/RESULTS.md): 64-key tiles for split (short or few) contexts, 128-key tiles for large unsplit batches of
    mixed lengths; 8 warps were slower everywhere. An FP8 cache: 128-key tiles split or not. No register limit:
    capped at 128 a thread, four FP8 programs fit an SM instead of three, but the batch took longer (bf16 too).
    FP8 unsplit: two pipeline stages, not three.

    bf16 unsplit: two stages, which give K and V one buffer each, so an SM holds two programs; three stages'
    second buffers leave room for one program an SM. Until the bf16 kernel loaded each tile's block ids a tile
    ahead, three stages gave one buffer too.
    """
    if head_dim > 128:
        return 32, 4, 3
    if num_splits == 1 and os.environ.get("MINIVLLM_DECODE_TILES"):
        return _tiles_setting(os.environ["MINIVLLM_DECODE_TILES"])
    if fp8:
        return 128, 4, (2 if num_splits == 1 else 3)
    return (128, 4, 2) if num_splits == 1 else (64, 4, 3)


@functools.lru_cache(maxsize=8)
def _tiles_setting(value: str) -> tuple[int, int, int]:
    """``MINIVLLM_DECODE_TILES=BLOCK_N,warps,stages``: the decode kernel's tiles for unsplit contexts (head_dim <= 128),
    for measuring other settings on a GPU (bench/gpu_throughput.py --env)."""
    try:
        block_n, warps, stages = (int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"MINIVLLM_DECODE_TILES must be BLOCK_N,warps,stages (e.g. 128,4,2), got {value!r}") from None
    if block_n not in (16, 32, 64, 128, 256) or warps not in (1, 2, 4, 8, 16) or not 1 <= stages <= 8:
        raise ValueError(f"MINIVLLM_DECODE_TILES: BLOCK_N one of 16, 32, 64, 128, 256, warps one of 1, 2, 4, 8, 16 "
                         f"and stages in [1, 8], got {value!r}")
    return block_n, warps, stages


def _group_pad(group: int) -> int:
    """Rows of the decode kernels' dots for ``group`` query heads a KV head: tl.dot takes 16 at the least."""
    return max(16, next_power_of_2(group))


def _decode_kv_heads(group: int, num_kv_heads: int, num_splits: int) -> int:
    """KV heads per program of the FP8 decode kernel (``KV_HEADS`` there): two where contexts are split in two and
    their query heads fit the 16 rows a dot pads to, else one: faster at 2 splits, slower with more (few rows want
    every program they can get), and unsplit no faster than the two pipeline stages alone (bench/RESULTS.md)."""
    if num_splits == 2 and 2 * group <= _group_pad(group) and num_kv_heads % 2 == 0:
        return 2
    return 1


def _interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``: CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _write_tokens(rows: int) -> int:
    """Tokens per program of the FP8 KV-write kernel for a step of ``rows`` tokens, tuned by a sweep over step
    sizes (bench/kv_write.py, queries rotated in programs of their own up to 512 tokens; bench/RESULTS.md)."""
    return 1 if rows <= 64 else 4 if rows <= 512 else 8


def _splits_queries(rows: int) -> bool:
    """Whether the FP8 KV-write kernel rotates a step's queries in programs of their own (a second row of the
    grid) rather than in those that write K and V: twice the programs, each half the work, which is what decode
    steps want; at 2,048 tokens the two are even (bench/kv_write.py; bench/RESULTS.md)."""
    return rows <= 512


@functools.lru_cache(maxsize=None)
def _limits_registers() -> bool:
    """Whether this Triton takes ``maxnreg`` (registers per thread at most) for NVIDIA GPUs."""
    if torch.version.hip is not None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "maxnreg" in CUDAOptions.__dataclass_fields__


def _fp8_ptx(q: torch.Tensor) -> bool:
    """Whether the FP8 decode kernel converts in inline PTX: 16-bit queries on an NVIDIA GPU of sm_89 or later
    (``cvt.rn.f16x2.e4m3x2``); not in the interpreter, which runs no PTX."""
    return q.is_cuda and q.dtype != torch.float32 and _converts_e4m3_pairs(q.device.index or 0)


_WORD_PAIRS: dict[tuple[int, int], bool] = {}


def _k_word_pairs(device_index: int, head_dim: int) -> bool:
    """``_word_pairs_hold``, checked once; under CUDA-graph capture, where the check cannot run, an unchecked
    device gets the byte-wise path (``compile_variants`` checks before any capture)."""
    key = (device_index, head_dim)
    if key not in _WORD_PAIRS:
        if torch.cuda.is_current_stream_capturing():
            return False
        _WORD_PAIRS[key] = _word_pairs_hold(device_index, head_dim)
    return _WORD_PAIRS[key]


def _word_pairs_hold(device_index: int, head_dim: int) -> bool:
    """Whether K's word-pair conversion (``_fp8_word_pairs_to_f16``) finds the register layout it relies on with
    this Triton and GPU: one small FP8 decode with it must give what the same decode converting each byte on
    its own gives (checked once per GPU and head size; a mismatch logs a warning and the kernel keeps the
    byte-wise path)."""
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device=device).manual_seed(0)
    blocks, block_size, kv_heads, group, seqs = 12, 16, 2, 2, 3
    shape = (blocks, block_size, kv_heads, head_dim)
    k_cache = (torch.rand(shape, generator=gen, device=device) * 8 - 4).to(FP8_DTYPE)
    v_cache = (torch.rand(shape, generator=gen, device=device) * 8 - 4).to(FP8_DTYPE)
    scales = tuple(torch.rand(shape[:3], generator=gen, device=device) + 0.5 for _ in range(2))
    q = torch.randn(seqs, kv_heads * group, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen, device=device)[: seqs * 4].view(seqs, 4).to(torch.int32)
    lens = torch.tensor([64, 37, 5], dtype=torch.int32, device=device)
    want, got = torch.empty_like(q), torch.empty_like(q)
    for out, pairs in ((want, False), (got, True)):
        _launch_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, out, 1, None, 0, scales, 0.0,
                       pairs)
    ok = bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
    if not ok:
        import logging

        logging.getLogger(__name__).warning(
            "FP8 decode: K's word-pair conversion does not match the byte-wise one with this Triton (max error "
            "%.3g); using the byte-wise conversion", (got.float() - want.float()).abs().max().item())
    return ok


@functools.lru_cache(maxsize=None)
def _converts_e4m3_pairs(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 9)


def _dot_dtype(dtype: torch.dtype, fp8: bool):
    """The dtype the kernels' dots run in: the queries', or float16 for 16-bit queries on an FP8 cache."""
    if not fp8 or dtype == torch.float32:
        return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
    return tl.float16


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would run through TF32 tensor cores by default: keep them exact.
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_attention_args(
    name: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Shapes, dtypes, devices and strides that both kernels rely on; raises ValueError."""
    def fail(msg: str) -> None:
        raise ValueError(f"{name}: {msg}")

    if q.dim() != 3:
        fail(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        fail("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
             f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        fail(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        fail(f"head_dim {head_dim} is not supported (one of {SUPPORTED_HEAD_DIMS})")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        fail(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.dtype not in SUPPORTED_DTYPES:
        fail(f"q dtype {q.dtype} is not supported (one of {SUPPORTED_DTYPES})")
    if kv_scales is None and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype):
        fail(f"cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must match q ({q.dtype})")
    if kv_scales is not None:
        _check_fp8_cache(fail, k_cache, v_cache, kv_scales)
    if out.shape != q.shape or out.dtype != q.dtype:
        fail(f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    num_seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        fail(f"block_tables must be a 2-D int32 tensor, got {tuple(block_tables.shape)} {block_tables.dtype}")
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32:
        fail(f"seq_lens must be int32 of shape ({num_seqs},), got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    for t_name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                      ("seq_lens", seq_lens), ("out", out)):
        if t.device != q.device:
            fail(f"{t_name} is on {t.device}, q on {q.device}")
    if not q.is_cuda and not _interpreted():
        fail(f"tensors are on {q.device}: the kernels need CUDA tensors (or TRITON_INTERPRET=1)")
    for t_name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache),
                      ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.numel() > 0 and t.stride(-1) != 1:
            fail(f"{t_name} must be contiguous in its last dimension, got strides {t.stride()}")


def _check_fp8_cache(fail, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     kv_scales: tuple[torch.Tensor, torch.Tensor]) -> None:
    """An FP8 cache: float8_e4m3 K/V and contiguous float32 scales of shape [num_blocks, block_size, kv_heads]."""
    if k_cache.dtype != FP8_DTYPE or v_cache.dtype != FP8_DTYPE:
        fail(f"with kv_scales the caches must be {FP8_DTYPE}, got {k_cache.dtype} and {v_cache.dtype}")
    for scales in kv_scales:
        if (scales.shape != k_cache.shape[:3] or scales.dtype != torch.float32 or scales.device != k_cache.device
                or scales.stride() != kv_scales[0].stride() or scales.stride(-1) != 1):
            fail(f"kv_scales must be two float32 tensors of shape {tuple(k_cache.shape[:3])} with one layout on "
                 f"{k_cache.device}, got {tuple(scales.shape)} {scales.dtype} strides {scales.stride()}")


def _scale_args(kv_scales, k_cache: torch.Tensor) -> tuple:
    """(k_scale_ptr, v_scale_ptr, stride_sb, stride_ss) for the kernels; the caches stand in without scales."""
    if kv_scales is None:
        return k_cache, k_cache, 0, 0
    return kv_scales[0], kv_scales[1], kv_scales[0].stride(0), kv_scales[0].stride(1)


def _check_scale(name: str, scale: float) -> None:
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name}: scale must be a positive finite float, got {scale!r}")


# --------------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------------


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, the query token included
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written in full
    num_splits: int | None = None,
    tiles: tuple | None = None,  # (BLOCK_N, warps, stages[, max registers a thread[, FP8: KV heads a program]]): sweeps
    window: int = 0,  # a sliding window: only the last ``window`` keys; 0: the whole context
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an FP8 cache's (k_scales, v_scales)
    softcap: float = 0.0,  # scores capped as softcap * tanh(scores / softcap) (Gemma 2); 0: off
    fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,  # (values, scales): the output quantized instead
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole cached context (flash-decoding).

    ``num_splits`` pieces of each context run in parallel and are merged by a second kernel
    (``None``: chosen by ``choose_num_splits`` from the table's capacity). Programs are handed
    to the GPU's schedulers in row order, so rows laid out longest context first (as the model
    runner lays them out) keep a batch of mixed lengths from ending on one long context. A
    sequence of length 0 (padding) gets zeros. Returns ``out``.

    ``fp8_out`` (split contexts only: the merge kernel writes it): the output is written quantized, as an FP8
    projection takes its input (``engine.models.fp8``), into float8_e4m3 ``values`` [rows, num_heads * head_dim]
    and float32 ``scales`` [rows, num_heads] (one per token and head, any strides with ``scales.stride(0) == 1``;
    rows >= num_seqs), instead of into ``out``: the rows rounded to ``out``'s dtype, then each head's absolute
    maximum mapped to 448, exactly what ``fp8_kernels.quantize_rows`` makes of ``out``. Rows past ``num_seqs``
    get zeros. Unsplit, the decode kernel quantizing its own rows was slower than a separate pass (bench/RESULTS.md).
    """
    _check_attention_args("paged_decode_attention", q, k_cache, v_cache, block_tables, seq_lens, out, kv_scales)
    _check_scale("paged_decode_attention", scale)
    num_seqs, num_heads, head_dim = q.shape
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_decode_attention: {block_tables.shape[0]} block table rows for {num_seqs} queries")
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_context_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, num_sms(q.device))
    if not isinstance(num_splits, int) or not 1 <= num_splits <= 256:
        raise ValueError(f"paged_decode_attention: num_splits must be an int in [1, 256], got {num_splits!r}")
    if num_seqs == 0:
        return out
    if fp8_out is not None:
        if num_splits == 1:
            raise ValueError("paged_decode_attention: fp8_out needs split contexts (num_splits > 1)")
        _check_fp8_out(q, fp8_out)
        values, scales = fp8_out
        if values.shape[0] > num_seqs:  # rows the product takes but no sequence fills: as quantize_rows pads
            values[num_seqs:].zero_()
            scales[num_seqs:].fill_(torch.finfo(torch.float32).tiny)
    fp8 = kv_scales is not None
    k_pairs = fp8 and _fp8_ptx(q) and _k_word_pairs(q.device.index or 0, head_dim)
    return _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, tiles, window,
                          kv_scales, softcap, k_pairs, fp8_out)


def _check_fp8_out(q: torch.Tensor, fp8_out) -> None:
    num_seqs, num_heads, head_dim = q.shape
    values, scales = fp8_out
    if (values.dtype != FP8_DTYPE or values.dim() != 2 or values.shape[0] < num_seqs
            or values.shape[1] != num_heads * head_dim or values.stride(1) != 1 or values.device != q.device):
        raise ValueError(f"paged_decode_attention: fp8_out's values must be float8_e4m3 [>= {num_seqs}, "
                         f"{num_heads * head_dim}] with contiguous rows on {q.device}, got {values.dtype} "
                         f"{tuple(values.shape)}")
    if (scales.dtype != torch.float32 or scales.shape != (values.shape[0], num_heads) or scales.stride(0) != 1
            or scales.device != q.device):
        raise ValueError(f"paged_decode_attention: fp8_out's scales must be float32 [{values.shape[0]}, "
                         f"{num_heads}] with stride(0) == 1 on {q.device}, got {scales.dtype} "
                         f"{tuple(scales.shape)} strides {scales.stride()}")


def _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, tiles, window,
                   kv_scales, softcap, k_pairs: bool, fp8_out=None) -> torch.Tensor:
    """The decode kernel (and the merge) on checked arguments; ``k_pairs``: an FP8 cache's K converted as word
    pairs (``_fp8_word_pairs_to_f16``)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_context_len = block_tables.shape[1] * block_size
    group = num_heads // num_kv_heads
    fp8 = kv_scales is not None
    block_n, num_warps, num_stages, max_registers, kv_heads = (
        *(tiles or _decode_tiles(head_dim, num_splits, fp8)), None, None)[:5]
    if kv_heads is None:
        kv_heads = _decode_kv_heads(group, num_kv_heads, num_splits) if fp8 else 1
    if num_kv_heads % kv_heads or (fp8 and group * kv_heads > _group_pad(group)) or (
            not fp8 and kv_heads != 1):
        raise ValueError(f"paged_decode_attention: {kv_heads} KV heads per program do not fit {num_kv_heads} KV "
                         f"heads of {group} query heads")
    launch_options = {"maxnreg": max_registers} if max_registers and q.is_cuda and _limits_registers() else {}
    scale_args = _scale_args(kv_scales, k_cache)
    scale_ptrs, scale_strides = scale_args[:2], scale_args[2:]
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: the kernel writes out directly
    kernel = _decode_split_fp8_kernel if fp8 else _decode_split_kernel
    # Rows on the grid's second axis where that pays (_decode_split_fp8_kernel); the bf16 kernel was slower so.
    heads_first = fp8 and num_splits == 1 and num_seqs <= _MAX_GRID_Y
    dtype_arg = {"DOT_DTYPE": _dot_dtype(q.dtype, True), "PTX": _fp8_ptx(q), "K_PAIRS": k_pairs,
                 "KV_HEADS": kv_heads, "HEADS_FIRST": heads_first} if fp8 else {}
    grid = (num_seqs, num_kv_heads // kv_heads, num_splits)
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if fp8:  # the FP8 kernel reads the caches as 16-bit words
        if any(st % 2 for st in cache_strides):
            raise ValueError(f"paged_decode_attention: an FP8 cache's strides must be even, got {cache_strides}")
        cache_strides = tuple(st // 2 for st in cache_strides)
    kernel[(grid[1], grid[0], grid[2]) if heads_first else grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        *scale_ptrs, scale if softcap else scale * LOG2_E, max_context_len, window, float(softcap),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), *cache_strides, *scale_strides,
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=_group_pad(group), HEAD_DIM=head_dim,
        PAGE_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(q.dtype), SLIDING=window > 0,
        SOFTCAP=bool(softcap), **dtype_arg, num_warps=num_warps, num_stages=num_stages, **launch_options,
    )
    if num_splits > 1:
        fp8_values, fp8_scales = fp8_out if fp8_out is not None else (out, out)  # the latter unused
        fp8_strides = (fp8_values.stride(0), fp8_scales.stride(1)) if fp8_out is not None else (0, 0)
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, fp8_values, fp8_scales, out.stride(0), out.stride(1), *fp8_strides,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            SPLITS_PAD=next_power_of_2(num_splits), FP8_OUT=fp8_out is not None, num_warps=4,
        )
    return out


def _prefill_tiles(max_query_len: int, group: int, head_dim: int, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages): rows just big enough for the longest query.

    64 x 64 tiles with 4 warps and 3 stages: the best of a sweep (bf16, head_dim 128, a W1-like 16k-token prefill
    step; 8 warps, 128-row and 128-key tiles were slower), and far fewer registers than 128 x 128. An FP8 cache
    takes 128-key tiles at 64 rows (bench/fp8_attention_sweep.py --prefill; the times are in bench/RESULTS.md).
    """
    block_m = min(64, max(16, next_power_of_2(max(max_query_len, 1) * group)))
    block_m = max(block_m, next_power_of_2(group))  # at least one token per tile
    if head_dim <= 128:
        return block_m, (128 if fp8 and block_m == 64 else 64), 4, 3
    return block_m, 32, 4, 2


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32, relative to its first entry
    seq_lens: torch.Tensor,  # [num_reqs] int32, new tokens included
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    window: int = 0,  # a sliding window: a query sees the last ``window`` positions; 0: all
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an FP8 cache's (k_scales, v_scales)
    softcap: float = 0.0,  # scores capped as softcap * tanh(scores / softcap) (Gemma 2); 0: off
    tiles: tuple[int, int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, num_warps, num_stages), for tuning sweeps
    skip_single: bool = False,  # leave requests of one new token (decodes) alone: their rows of ``out`` too
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over their cached context and themselves.

    Request i's tokens are ``q[query_start_loc[i] - query_start_loc[0] : query_start_loc[i + 1] - ...]``,
    the last ``query_len`` positions of its ``seq_lens[i]`` (their K/V are already in the cache).
    Any query lengths work, 1 (decode) and 0 included; ``max_query_len`` only picks the tile size.
    Rows of ``out`` past the last request are not written. Returns ``out``.
    """
    name = "paged_prefill_attention"
    _check_attention_args(name, q, k_cache, v_cache, block_tables, seq_lens, out, kv_scales)
    _check_scale(name, scale)
    num_reqs = block_tables.shape[0]
    if (query_start_loc.shape != (num_reqs + 1,) or query_start_loc.dtype != torch.int32
            or query_start_loc.device != q.device):
        raise ValueError(f"{name}: query_start_loc must be int32 of shape ({num_reqs + 1},) on {q.device}, "
                         f"got {tuple(query_start_loc.shape)} {query_start_loc.dtype} on {query_start_loc.device}")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"{name}: max_query_len must be a non-negative int, got {max_query_len!r}")
    num_tokens, num_heads, head_dim = q.shape
    if num_reqs == 0 or num_tokens == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = tiles or _prefill_tiles(max_query_len, group, head_dim,
                                                                      kv_scales is not None)
    if tiles is not None and (block_m % group or any(t & (t - 1) for t in (block_m, block_n))):
        raise ValueError(f"{name}: tiles {tiles} need powers of two, rows a multiple of the group ({group})")
    block_q = block_m // group
    num_tiles = num_tokens // block_q + num_reqs  # an upper bound; spare tiles return at once
    scale_args = _scale_args(kv_scales, k_cache)
    heads_first = num_tiles <= _MAX_GRID_Y  # the tiles then take the grid's second axis
    _prefill_kernel[(num_kv_heads, num_tiles) if heads_first else (num_tiles, num_kv_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, *scale_args[:2],
        scale if softcap else scale * LOG2_E, num_reqs, block_tables.shape[1] * block_size, window, float(softcap),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *scale_args[2:],
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), SLIDING=window > 0, FP8=kv_scales is not None,
        SOFTCAP=bool(softcap), DOT_DTYPE=_dot_dtype(q.dtype, kv_scales is not None), HEADS_FIRST=heads_first,
        SKIP_SINGLE=skip_single, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def write_paged_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot is skipped
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an FP8 cache's scales, written too
    q: torch.Tensor | None = None,  # [>= num_tokens, num_heads, head_dim]: the step's queries
    tokens_per_program: int | None = None,  # FP8: a power of two up to 16, for tuning sweeps; None: chosen here
    split_queries: bool | None = None,  # FP8: the queries in programs of their own; None: chosen here
    rope=None,  # the rope q and k still need (``engine.models.layers.PendingRope``, see below)
    fuse_rope: bool | None = None,  # FP8: rope in the write kernel itself; None: chosen here (for tuning sweeps)
) -> torch.Tensor | None:
    """Store the new tokens' K and V in their cache slots (quantized for FP8), and return the
    queries the attention kernels must read the cache with.

    An FP8 cache holds K rotated (``kvcache.paged_cache``); given ``q``, the same launch returns the queries rotated
    alike (as a new tensor). Returns ``q`` itself where nothing is done to it (no rope, and a 16-bit cache or a head
    dim that is not a power of two).

    ``rope`` (needs ``q``): q and k arrive as the q|k|v projection left them, and the write applies what they still
    need, as ``engine.ops.fused.rotary`` / ``qk_norm_rotary`` would have, bit for bit: rope at
    ``rope.positions`` ([q rows], or [3, q rows] with ``rope.mrope_section``) from ``rope.cos_sin_cache``, after
    Qwen3's per-head RMSNorm where ``rope.q_weight``/``rope.k_weight`` are given (``rope.eps``); and first, where
    ``rope.column_scales`` is given (float32, one per column of q|k|v), each of q's, k's and v's values times its
    column's scale, rounded to the model dtype (``fp8_kernels.scale_columns_``'s arithmetic). Every row of q comes
    back roped (and rotated for an FP8 cache that rotates K), as a new tensor. On a 16-bit cache K goes into its
    slot roped with no k_out in between, in one launch (``fused_ops.rotary_into_cache``: the rope kernel, its K
    programs storing K and V in the cache). On an FP8 cache the rope kernel runs first
    (``fused_ops.rotary_with_column_scales``) and the write follows, applying V's column scales; with
    ``fuse_rope`` (up to ``_FP8_FUSED_ROPE_MAX_ROWS`` rows when None) the FP8 write kernel ropes K's rows after
    loading them and before rotating and quantizing them, and the queries alike, in one launch. ``rope.partials``
    (a 16-bit cache only): q, k and v are views of the first of these partial products of q|k|v, which that launch
    adds up as it reads them (``fused_ops.rotary_into_cache``).
    """
    def fail(msg: str) -> None:
        raise ValueError(f"write_paged_kv: {msg}")

    if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        fail(f"caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] of one shape, got "
             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    row_shape = tuple(k_cache.shape[2:])
    num_tokens = slot_mapping.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != row_shape or t.shape[0] < num_tokens:
            fail(f"{name} must be [>= {num_tokens}, {row_shape[0]}, {row_shape[1]}], got {tuple(t.shape)}")
        if (t.dtype != k_cache.dtype and kv_scales is None) or t.device != k_cache.device:
            fail(f"{name} is {t.dtype} on {t.device}, the cache {k_cache.dtype} on {k_cache.device}")
        if t.stride(2) != 1 or t.stride(1) != row_shape[1]:
            fail(f"{name} rows must be contiguous (num_kv_heads * head_dim), got strides {t.stride()}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64 or slot_mapping.device != k_cache.device:
        fail(f"slot_mapping must be 1-D int64 on {k_cache.device}, got {tuple(slot_mapping.shape)} "
             f"{slot_mapping.dtype} on {slot_mapping.device}")
    if kv_scales is not None:
        _check_fp8_cache(fail, k_cache, v_cache, kv_scales)
        if not all(t.is_contiguous() for t in kv_scales):
            fail("kv_scales must be contiguous")
    rotate = kv_scales is not None and rotates_keys(row_shape[1])
    if q is not None and (q.dim() != 3 or q.shape[0] < num_tokens or q.shape[2] != row_shape[1]
                          or q.stride(2) != 1 or q.device != k_cache.device):
        fail(f"q must be [>= {num_tokens}, num_heads, {row_shape[1]}] on {k_cache.device} with contiguous rows, "
             f"got {tuple(q.shape)} strides {q.stride()}")
    if tokens_per_program is not None and tokens_per_program not in (1, 2, 4, 8, 16):
        fail(f"tokens_per_program must be a power of two up to 16, got {tokens_per_program!r}")
    v_column_scales = None  # q|k|v's column scales when only V's are left to apply
    if rope is not None:
        if q is None:
            fail("rope needs q")
        if v.dtype != k.dtype:
            fail(f"with rope, v must be k's dtype {k.dtype}, got {v.dtype}")
        if kv_scales is None:
            return rotary_into_cache(rope.positions, q, k, v, k_cache, v_cache, slot_mapping, rope.cos_sin_cache,
                                     rope.q_weight, rope.k_weight, rope.eps, rope.mrope_section, rope.column_scales,
                                     rope.partials)
        if rope.partials is not None:
            fail("partial products of q|k|v (a product cut along K) go to a 16-bit cache only")
        if not (fuse_rope if fuse_rope is not None else q.shape[0] <= _FP8_FUSED_ROPE_MAX_ROWS):
            # The rope kernel first (q's and k's column scales with it), then the write, which scales V: where
            # fusing them measured slower (_FP8_FUSED_ROPE_MAX_ROWS).
            q, k = rotary_with_column_scales(rope.positions, q, k, rope.cos_sin_cache, rope.q_weight, rope.k_weight,
                                             rope.eps, rope.mrope_section, rope.column_scales)
            v_column_scales, rope = rope.column_scales, None
        else:  # the two calls above check their rope inputs themselves
            rope_strides = check_rope_inputs("write_paged_kv", rope.positions, q, k, rope.cos_sin_cache,
                                             rope.q_weight, rope.k_weight, rope.mrope_section, rope.column_scales)
    queries = q is not None and (rotate or rope is not None)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if queries else q
    rows = q.shape[0] if queries else num_tokens
    if kv_scales is not None and rows > 0:
        tokens = tokens_per_program or _write_tokens(rows)
        min_rows = 16 // tokens if rotate else 1  # tl.dot takes 16 rows or more
        q_heads = q.shape[1] if q is not None else 1  # with column scales it places k's and v's
        split_q = queries and (split_queries if split_queries is not None else _splits_queries(rows))
        head_dim = row_shape[1]
        placeholder = q if queries else k  # for the pointers a variant does not read
        if rope is not None:
            stride_p, stride_pr, section_1, section_2 = rope_strides
            has_norm, column_scales = rope.q_weight is not None, rope.column_scales
            rope_args = (rope.positions, rope.cos_sin_cache, rope.q_weight if has_norm else placeholder,
                         rope.k_weight if has_norm else placeholder,
                         column_scales if column_scales is not None else placeholder, float(rope.eps))
            rope_strides_args = (stride_p, stride_pr, rope.cos_sin_cache.stride(0))
        else:  # V's column scales, where the queries and K were scaled and roped apart
            stride_p = stride_pr = section_1 = section_2 = 0
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
            NUM_KV_HEADS=row_shape[0], HEADS_PAD=max(next_power_of_2(row_shape[0]), min_rows),
            HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim),
            HALF_PAD=next_power_of_2(max(head_dim // 2, 1)), NUM_Q_HEADS=q_heads,
            Q_HEADS_PAD=q_heads_pad, TOKENS=tokens, ROTATE=rotate,
            QUERIES=queries, SPLIT_Q=split_q, ROPE=rope is not None, HAS_NORM=has_norm,
            MROPE=rope is not None and rope.mrope_section is not None, SECTION_1=section_1, SECTION_2=section_2,
            COL_SCALES=column_scales is not None, DOT_PRECISION=_dot_precision(k.dtype), INTERPRET=_interpreted(),
            Q_CHUNK=min(q_heads_pad, max(32 // tokens, 1)) if rope is not None else q_heads_pad,
            num_warps=4, enable_fp_fusion=False,
        )
        return q_out
    if kv_scales is not None or num_tokens == 0:
        return q_out
    row = row_shape[0] * row_shape[1]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        ROW=row, ROW_PAD=next_power_of_2(row), num_warps=4,
    )
    return q_out


def compile_variants(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     max_query_len: int, window: int = 0, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     dtype: torch.dtype | None = None, softcap: float = 0.0, fp8_out: bool = False) -> int:
    """Compile every kernel variant a step can pick (each split count, each prefill tile height; with
    ``fp8_out`` the merge's quantized output too) now, so that no step waits for a compile mid-run.
    ``block_tables`` should be the caller's own table buffer, so that its row stride matches the steps'
    tables. Returns how many variants ran; once Triton's on-disk cache holds them this takes well under a
    second.
    """
    head_dim, device = k_cache.shape[3], k_cache.device
    group = num_heads // k_cache.shape[2]
    table = block_tables[:1]
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype or k_cache.dtype, device=device)
    out = torch.empty_like(q)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)  # position 0 of the block the row names
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    num_splits, variants = 1, 0
    while num_splits <= MAX_NUM_SPLITS:
        paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 1.0, out, num_splits, window=window,
                               kv_scales=kv_scales, softcap=softcap)
        if fp8_out and num_splits > 1:
            quantized = (torch.empty(4, num_heads * head_dim, dtype=FP8_DTYPE, device=device),
                         torch.empty(num_heads, 4, dtype=torch.float32, device=device).t())
            paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 1.0, out, num_splits,
                                   window=window, kv_scales=kv_scales, softcap=softcap, fp8_out=quantized)
            variants += 1
        num_splits, variants = num_splits * 2, variants + 1
    tiles, query_len = set(), 1
    while query_len < 2 * max(max_query_len, 1):
        n = min(query_len, max_query_len)
        tile = _prefill_tiles(n, group, head_dim, kv_scales is not None)
        if tile not in tiles:
            tiles.add(tile)
            paged_prefill_attention(q, k_cache, v_cache, table, query_start_loc, seq_lens, n, 1.0, out, window=window,
                                    kv_scales=kv_scales, softcap=softcap)
        query_len *= 2
    return variants + len(tiles)


def compile_write_variants(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, max_tokens: int,
                           kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           dtype: torch.dtype | None = None, rope=None, column_scales: bool = False) -> int:
    """Compile every variant of the KV-cache write a step can pick, as the Triton backend calls ``write_paged_kv``
    (with the layer's ``rope``, an ``engine.models.layers.PendingRope``, if it has one): on an FP8 cache each
    choice of tokens per program and of programs for the queries (``_write_tokens``, ``_splits_queries``) up to
    ``max_tokens`` tokens a step; with ``column_scales`` (FP8 q|k|v products that may leave their scales to the
    write) each with and without them. q, k and v are views of one q|k|v tensor, as the models pass them; every
    slot is -1, so nothing is written. Returns how many variants ran."""
    num_kv_heads, head_dim, device = k_cache.shape[2], k_cache.shape[3], k_cache.device
    dtype = dtype or k_cache.dtype
    sizes, rows = {}, 1
    while rows <= max(max_tokens, 1):  # the choices change at powers of two: one step size past each
        key = ((_write_tokens(rows), _splits_queries(rows), rows > _FP8_FUSED_ROPE_MAX_ROWS) if kv_scales is not None
               else None)
        sizes.setdefault(key, rows)
        rows = 2 if rows == 1 else 2 * rows - 1
    width = (num_heads + 2 * num_kv_heads) * head_dim
    variants = 0
    for rows in sizes.values():
        for scaled in (False, True) if column_scales and rope is not None else (False,):
            qkv = torch.zeros(rows, width, dtype=dtype, device=device)
            q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
            step_rope = None
            if rope is not None:
                positions = torch.zeros((rows,) if rope.mrope_section is None else (3, rows), dtype=torch.int64,
                                        device=device)
                step_rope = rope.at(positions, torch.ones(width, device=device) if scaled else None)
            write_paged_kv(k.view(rows, num_kv_heads, head_dim), v.view(rows, num_kv_heads, head_dim), k_cache,
                           v_cache, torch.full((rows,), -1, dtype=torch.int64, device=device), kv_scales,
                           q=q.view(rows, num_heads, head_dim), rope=step_rope)
            variants += 1
    return variants
