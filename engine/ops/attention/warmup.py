"""Start-up compiles: every variant of the attention kernels and of the KV-cache write that a step can pick, run
once through the checked one-shot functions, so that no step waits for a compile mid-run (and the runner's block
table buffer and the model's dtype are checked against the cache once)."""

from __future__ import annotations

import torch

from engine.ops.attention.launch import (
    _FP8_FUSED_ROPE_MAX_ROWS,
    MAX_NUM_SPLITS,
    _prefill_tiles,
    _splits_queries,
    _write_tokens,
)
from engine.ops.attention.paged import paged_decode_attention, paged_prefill_attention, write_paged_kv
from kvcache.paged_cache import FP8_DTYPE


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
    (with the layer's ``rope``, an ``engine.models.rotary.PendingRope``, if it has one): on an FP8 cache each
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
