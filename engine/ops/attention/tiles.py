"""Device functions that the attention kernels share: key tiles read in place through the block table, soft-capped
scores, and the decode kernels' split ranges and stores.

A key tile of ``BLOCK_N`` positions may span several cache blocks; tiles start on block boundaries, so each block's
id is loaded once per tile and serves its keys' K, V (and FP8 scales)::

    position p  ->  block_tables[seq, p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

import triton
import triton.language as tl


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

