"""The attention kernels' entry points: ``PagedAttention``, bound to one layer's cache and checked once, for the
backend's steps; ``paged_decode_attention``, ``paged_prefill_attention`` and ``write_paged_kv``, which check every
argument on every call, for everything else (tests, benchmarks, start-up's compiles)."""

from __future__ import annotations

import torch

from engine.ops.attention.checks import (
    _check_cache,
    _check_fp8_out,
    _check_fp8_strides,
    _check_heads,
    _check_queries,
    _check_scale,
    _check_tables,
    _check_writable,
    _check_write_rope,
    _check_write_rows,
)
from engine.ops.attention.decode import _launch_decode
from engine.ops.attention.kv_write import _launch_write
from engine.ops.attention.launch import _FP8_FUSED_ROPE_MAX_ROWS, choose_num_splits, num_sms
from engine.ops.attention.prefill import _launch_prefill
from engine.ops.fused import check_rope_tables

KVScales = tuple[torch.Tensor, torch.Tensor]  # an FP8 cache's (k_scales, v_scales), [num_blocks, block_size, kvh]


class PagedAttention:
    """The attention kernels bound to one layer's paged KV cache.

    Binding checks what every step's launches rely on and no step changes: the caches (shapes, dtypes, strides, an
    FP8 cache's scales), the layer's heads, scale, window and soft cap, and the tables of its rope where it has one.
    A step's calls (``write``, ``decode``, ``prefill``) check nothing more: their tensors are the step's, laid out by
    the model runner (``engine.attention.metadata``), and start-up compiles every launch a step can pick through the
    checked one-shot functions (``compile_variants``), on the runner's block-table buffer and in the model's dtype.
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
                 kv_scales: KVScales | None = None, window: int = 0, softcap: float = 0.0, rope=None):
        name = "PagedAttention"
        _check_cache(name, k_cache, v_cache, kv_scales)
        _check_heads(name, num_heads, k_cache)
        _check_fp8_strides(name, k_cache, v_cache, kv_scales)
        _check_writable(name, k_cache, v_cache, kv_scales)
        _check_scale(name, scale)
        if not isinstance(window, int) or window < 0:
            raise ValueError(f"{name}: window must be a non-negative int (0: none), got {window!r}")
        if not (isinstance(softcap, (int, float)) and 0 <= softcap < float("inf")):
            raise ValueError(f"{name}: softcap must be a finite float >= 0 (0: none), got {softcap!r}")
        if rope is not None:
            check_rope_tables(name, k_cache.shape[3], k_cache.device, rope.cos_sin_cache, rope.q_weight,
                              rope.k_weight, rope.mrope_section)
        self.k_cache, self.v_cache, self.kv_scales = k_cache, v_cache, kv_scales
        self.num_heads, self.scale, self.window, self.softcap = num_heads, scale, window, softcap
        self.block_size, self.num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        self._num_sms = num_sms(k_cache.device)

    def num_splits(self, num_seqs: int, table_width: int) -> int:
        """``choose_num_splits`` for ``num_seqs`` decode rows of block tables ``table_width`` blocks wide. Under a
        CUDA graph the table's shape is what stays fixed across replays, so the split count follows its capacity,
        not the step's lengths."""
        return choose_num_splits(num_seqs, self.num_kv_heads, table_width * self.block_size, self._num_sms)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, q: torch.Tensor | None = None,
              rope=None) -> torch.Tensor | None:
        """``write_paged_kv`` into this cache: K and V stored, the queries to attend with returned."""
        return _launch_write(k, v, self.k_cache, self.v_cache, slot_mapping, self.kv_scales, q, rope)

    def decode(self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
               num_splits: int, fp8_out: KVScales | None = None) -> torch.Tensor:
        """``paged_decode_attention`` on this cache (``fp8_out`` with ``num_splits`` > 1 only)."""
        return _launch_decode(q, self.k_cache, self.v_cache, block_tables, seq_lens, self.scale, out, num_splits,
                              self.window, self.kv_scales, self.softcap, fp8_out)

    def prefill(self, q: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, max_query_len: int, out: torch.Tensor,
                skip_single: bool = False) -> torch.Tensor:
        """``paged_prefill_attention`` on this cache."""
        return _launch_prefill(q, self.k_cache, self.v_cache, block_tables, query_start_loc, seq_lens, max_query_len,
                               self.scale, out, self.window, self.kv_scales, self.softcap, skip_single)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, the query token included
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written in full
    num_splits: int | None = None,
    window: int = 0,  # a sliding window: only the last ``window`` keys; 0: the whole context
    kv_scales: KVScales | None = None,  # an FP8 cache's (k_scales, v_scales)
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
    name = "paged_decode_attention"
    _check_cache(name, k_cache, v_cache, kv_scales)
    _check_queries(name, q, out, k_cache, kv_scales)
    _check_heads(name, q.shape[1], k_cache)
    _check_fp8_strides(name, k_cache, v_cache, kv_scales)
    _check_tables(name, q, block_tables, seq_lens)
    _check_scale(name, scale)
    num_seqs = q.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"{name}: {block_tables.shape[0]} block table rows for {num_seqs} queries")
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1],
                                       num_sms(q.device))
    if not isinstance(num_splits, int) or not 1 <= num_splits <= 256:
        raise ValueError(f"{name}: num_splits must be an int in [1, 256], got {num_splits!r}")
    if fp8_out is not None and num_seqs > 0:
        if num_splits == 1:
            raise ValueError(f"{name}: fp8_out needs split contexts (num_splits > 1)")
        _check_fp8_out(q, fp8_out)
    return _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, window, kv_scales,
                          softcap, fp8_out)


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
    kv_scales: KVScales | None = None,  # an FP8 cache's (k_scales, v_scales)
    softcap: float = 0.0,  # scores capped as softcap * tanh(scores / softcap) (Gemma 2); 0: off
    skip_single: bool = False,  # leave requests of one new token (decodes) alone: their rows of ``out`` too
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over their cached context and themselves.

    Request i's tokens are ``q[query_start_loc[i] - query_start_loc[0] : query_start_loc[i + 1] - ...]``,
    the last ``query_len`` positions of its ``seq_lens[i]`` (their K/V are already in the cache).
    Any query lengths work, 1 (decode) and 0 included; ``max_query_len`` only picks the tile size.
    Rows of ``out`` past the last request are not written. Returns ``out``.
    """
    name = "paged_prefill_attention"
    _check_cache(name, k_cache, v_cache, kv_scales)
    _check_queries(name, q, out, k_cache, kv_scales)
    _check_heads(name, q.shape[1], k_cache)
    _check_tables(name, q, block_tables, seq_lens)
    _check_scale(name, scale)
    num_reqs = block_tables.shape[0]
    if (query_start_loc.shape != (num_reqs + 1,) or query_start_loc.dtype != torch.int32
            or query_start_loc.device != q.device):
        raise ValueError(f"{name}: query_start_loc must be int32 of shape ({num_reqs + 1},) on {q.device}, "
                         f"got {tuple(query_start_loc.shape)} {query_start_loc.dtype} on {query_start_loc.device}")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"{name}: max_query_len must be a non-negative int, got {max_query_len!r}")
    return _launch_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out,
                           window, kv_scales, softcap, skip_single)


def write_paged_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot is skipped
    kv_scales: KVScales | None = None,  # an FP8 cache's scales, written too
    q: torch.Tensor | None = None,  # [>= num_tokens, num_heads, head_dim]: the step's queries
    rope=None,  # the rope q and k still need (``engine.models.rotary.PendingRope``, see below)
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
    slot roped with no k_out in between, in one launch (``fused_ops.launch_rope_into_cache``: the rope kernel, its
    K programs storing K and V in the cache). On an FP8 cache the rope kernel runs first (``fused_ops.launch_rope``)
    and the write follows, applying V's column scales (``kv_write`` says why not in one launch). ``rope.partials``
    (a 16-bit cache only): q, k and v are views of the first of these partial products of q|k|v, which that launch
    adds up as it reads them.
    """
    name = "write_paged_kv"
    _check_cache(name, k_cache, v_cache, kv_scales)
    _check_writable(name, k_cache, v_cache, kv_scales)
    _check_write_rows(name, k, v, q, slot_mapping, k_cache, kv_scales)
    if rope is not None:  # an FP8 cache's rope kernel runs apart from the write past _FP8_FUSED_ROPE_MAX_ROWS rows
        _check_write_rope(name, rope, q, k, v, kv_scales, apart=q is None or q.shape[0] > _FP8_FUSED_ROPE_MAX_ROWS)
    return _launch_write(k, v, k_cache, v_cache, slot_mapping, kv_scales, q, rope)
