"""Prefill attention: a varlen batch of new tokens (prefill, chunked prefill, decode rows too) attending causally to
their cached context and to themselves.

Query tokens of one request are packed with their query heads into row tiles (grid ``(query tiles,
num_kv_heads)``, KV heads first where the grid allows); a program finds its request by binary search over the
query start offsets. K/V are read in place through the block table, one block id per block of a key tile. The
kernel is correct for decode rows too, but slower there than the decode kernel, so the backend uses both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.attention.launch import _MAX_GRID_Y, LOG2_E, _dot_dtype, _dot_precision, _prefill_tiles, _scale_args
from engine.ops.attention.tiles import _soft_cap, _tile_blocks
from engine.ops.triton_helpers import jit_without_specializing


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


@jit_without_specializing("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr", "num_reqs", "max_context_len",
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


def _launch_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out,
                    window=0, kv_scales=None, softcap=0.0, skip_single=False, tiles=None) -> torch.Tensor:
    """The prefill kernel on checked arguments: ``paged_prefill_attention``'s. ``tiles`` (BLOCK_M, BLOCK_N,
    num_warps, num_stages) replaces ``_prefill_tiles``'s choice, for sweeps."""
    num_reqs = block_tables.shape[0]
    num_tokens, num_heads, head_dim = q.shape
    if num_reqs == 0 or num_tokens == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = tiles or _prefill_tiles(max_query_len, group, head_dim,
                                                                      kv_scales is not None)
    if tiles is not None and (block_m % group or any(t & (t - 1) for t in (block_m, block_n))):
        raise ValueError(f"paged_prefill_attention: tiles {tiles} need powers of two, rows a multiple of the group "
                         f"({group})")
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
