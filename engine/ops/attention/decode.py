"""Decode attention: one new token per sequence over its whole cached context (flash-decoding).

The context is cut into ``num_splits`` pieces that run in parallel (grid ``(num_seqs, num_kv_heads, num_splits)``);
each writes a partial output and its log-sum-exp, and a small second kernel merges them (``_decode_merge_kernel``,
which may also write the output quantized as an FP8 projection's input). One program owns one KV head and all
the query heads that share it, so each K/V tile is loaded once per group rather than once per query head.
A cache in the queries' dtype runs ``_decode_split_kernel``; an FP8 cache runs ``decode_fp8``'s kernel.
"""

from __future__ import annotations

import logging

import torch
import triton.language as tl

from engine.ops.attention.decode_fp8 import _decode_split_fp8_kernel
from engine.ops.attention.launch import (
    _MAX_GRID_Y,
    LOG2_E,
    _decode_kv_heads,
    _decode_tiles,
    _dot_dtype,
    _dot_precision,
    _fp8_ptx,
    _group_pad,
    _limits_registers,
    _scale_args,
)
from engine.ops.attention.tiles import (
    _soft_cap,
    _split_range,
    _store_decode_lse,
    _store_decode_rows,
    _tile_page_ids,
    _tile_rows,
)
from engine.ops.intmath import next_power_of_2
from engine.ops.triton_helpers import jit_without_specializing
from kvcache.paged_cache import FP8_DTYPE

logger = logging.getLogger(__name__)


@jit_without_specializing("block_tables_ptr", "seq_lens_ptr", "max_context_len", "window")
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


@jit_without_specializing("stride_fs")
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


def _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, window=0, kv_scales=None,
                   softcap=0.0, fp8_out=None, tiles=None, k_pairs=None) -> torch.Tensor:
    """The decode kernel (and the merge) on checked arguments: ``paged_decode_attention``'s, ``num_splits`` given.
    ``tiles`` (BLOCK_N, warps, stages[, registers a thread at most[, FP8: KV heads a program]]) replaces the
    launch's own choice, for sweeps; ``k_pairs`` says whether an FP8 cache's K is converted as word pairs
    (``_fp8_word_pairs_to_f16``; by default where ``_word_pairs_hold`` found that it works)."""
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    fp8 = kv_scales is not None
    if fp8_out is not None and fp8_out[0].shape[0] > num_seqs:  # rows the product takes but no sequence fills
        fp8_out[0][num_seqs:].zero_()  # as quantize_rows pads
        fp8_out[1][num_seqs:].fill_(torch.finfo(torch.float32).tiny)
    if tiles is None:
        block_n, num_warps, num_stages = _decode_tiles(head_dim, num_splits, fp8)
        max_registers, kv_heads = None, _decode_kv_heads(group, num_kv_heads, num_splits) if fp8 else 1
    else:
        block_n, num_warps, num_stages, max_registers, kv_heads = _sweep_tiles(tiles, group, num_kv_heads, num_splits,
                                                                               fp8)
    launch_options = {"maxnreg": max_registers} if max_registers and q.is_cuda and _limits_registers() else {}
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: the kernel writes out directly
    # Rows on the grid's second axis where that pays (_decode_split_fp8_kernel); the bf16 kernel was slower so.
    heads_first = fp8 and num_splits == 1 and num_seqs <= _MAX_GRID_Y
    grid = (num_seqs, num_kv_heads // kv_heads, num_splits)
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if fp8:  # the FP8 kernel reads the caches as 16-bit words (their strides are even: checks.check_fp8_strides)
        cache_strides = tuple(st // 2 for st in cache_strides)
        if k_pairs is None:
            k_pairs = _fp8_ptx(q) and _k_word_pairs(q.device.index or 0, head_dim)
        kernel, fp8_args = _decode_split_fp8_kernel, {
            "DOT_DTYPE": _dot_dtype(q.dtype, True), "PTX": _fp8_ptx(q), "K_PAIRS": k_pairs, "KV_HEADS": kv_heads,
            "HEADS_FIRST": heads_first}
    else:
        kernel, fp8_args = _decode_split_kernel, {}
    scale_args = _scale_args(kv_scales, k_cache)
    kernel[(grid[1], grid[0], grid[2]) if heads_first else grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        *scale_args[:2], scale if softcap else scale * LOG2_E, block_tables.shape[1] * block_size, window,
        float(softcap), q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *cache_strides, *scale_args[2:],
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=_group_pad(group), HEAD_DIM=head_dim,
        PAGE_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(q.dtype), SLIDING=window > 0,
        SOFTCAP=bool(softcap), **fp8_args, num_warps=num_warps, num_stages=num_stages, **launch_options,
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


def _sweep_tiles(tiles: tuple, group: int, num_kv_heads: int, num_splits: int, fp8: bool) -> tuple:
    """(BLOCK_N, warps, stages, registers a thread at most or None, KV heads a program) from a sweep's ``tiles``
    (the KV heads the launch would pick where they leave them out), refused where the KV heads do not fit the
    program's rows."""
    block_n, num_warps, num_stages, max_registers, kv_heads = (*tiles, None, None)[:5]
    if kv_heads is None:
        kv_heads = _decode_kv_heads(group, num_kv_heads, num_splits) if fp8 else 1
    if num_kv_heads % kv_heads or (fp8 and group * kv_heads > _group_pad(group)) or (not fp8 and kv_heads != 1):
        raise ValueError(f"paged_decode_attention: {kv_heads} KV heads per program do not fit {num_kv_heads} KV "
                         f"heads of {group} query heads")
    return block_n, num_warps, num_stages, max_registers, kv_heads


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
        _launch_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, out, 1, kv_scales=scales, k_pairs=pairs)
    ok = bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
    if not ok:
        logger.warning(
            "FP8 decode: K's word-pair conversion does not match the byte-wise one with this Triton (max error "
            "%.3g); using the byte-wise conversion", (got.float() - want.float()).abs().max().item())
    return ok
