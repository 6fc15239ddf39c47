"""Argument checks of the attention kernels; each raises ValueError naming the call and the argument.

What a layer's launches rely on from step to step (its cache, heads and scale) is checked once when
``PagedAttention`` binds it; the one-shot functions (``paged_decode_attention`` ...) check that and their step's
tensors on every call.
"""

from __future__ import annotations

import math

import torch

from engine.ops.fused import check_partials, check_rope_inputs
from engine.ops.triton_helpers import interpreted
from kvcache.paged_cache import FP8_DTYPE

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)


def _fail(name: str, msg: str) -> None:
    raise ValueError(f"{name}: {msg}")


# --------------------------------------------------------------------------------------------
# A layer's cache and configuration
# --------------------------------------------------------------------------------------------


def _check_cache(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales) -> None:
    """K and V caches [num_blocks, block_size, num_kv_heads, head_dim] of one shape, dtype and device, contiguous in
    their last dimension; with ``kv_scales`` float8_e4m3 with float32 scales [num_blocks, block_size, num_kv_heads]
    of one layout."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        _fail(name, "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                    f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if kv_scales is None and (k_cache.dtype not in SUPPORTED_DTYPES or v_cache.dtype != k_cache.dtype):
        _fail(name, f"cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must be one of {SUPPORTED_DTYPES}, the same")
    if kv_scales is not None:
        _check_fp8_cache(name, k_cache, v_cache, kv_scales)
    if v_cache.device != k_cache.device:
        _fail(name, f"v_cache is on {v_cache.device}, k_cache on {k_cache.device}")
    if not k_cache.is_cuda and not interpreted():
        _fail(name, f"tensors are on {k_cache.device}: the kernels need CUDA tensors (or TRITON_INTERPRET=1)")
    for t_name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.numel() > 0 and t.stride(-1) != 1:
            _fail(name, f"{t_name} must be contiguous in its last dimension, got strides {t.stride()}")


def _check_fp8_cache(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     kv_scales: tuple[torch.Tensor, torch.Tensor]) -> None:
    """An FP8 cache: float8_e4m3 K/V and float32 scales of shape [num_blocks, block_size, kv_heads], one layout."""
    if k_cache.dtype != FP8_DTYPE or v_cache.dtype != FP8_DTYPE:
        _fail(name, f"with kv_scales the caches must be {FP8_DTYPE}, got {k_cache.dtype} and {v_cache.dtype}")
    for scales in kv_scales:
        if (scales.shape != k_cache.shape[:3] or scales.dtype != torch.float32 or scales.device != k_cache.device
                or scales.stride() != kv_scales[0].stride() or scales.stride(-1) != 1):
            _fail(name, f"kv_scales must be two float32 tensors of shape {tuple(k_cache.shape[:3])} with one layout "
                        f"on {k_cache.device}, got {tuple(scales.shape)} {scales.dtype} strides {scales.stride()}")


def _check_heads(name: str, num_heads: int, k_cache: torch.Tensor) -> None:
    """Query heads a whole number of groups of the cache's KV heads, of a head size the attention kernels take."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        _fail(name, f"head_dim {head_dim} is not supported (one of {SUPPORTED_HEAD_DIMS})")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        _fail(name, f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def _check_fp8_strides(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales) -> None:
    """The FP8 decode kernel reads the caches as 16-bit words: their strides must be even."""
    strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if kv_scales is not None and any(st % 2 for st in strides):
        _fail(name, f"an FP8 cache's strides must be even, got {strides}")


def _check_writable(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales) -> None:
    """The KV-cache write addresses a slot's row as ``slot * num_kv_heads * head_dim``: contiguous caches (and
    scales)."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        _fail(name, f"caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim], got strides "
                    f"{k_cache.stride()} and {v_cache.stride()}")
    if kv_scales is not None and not all(t.is_contiguous() for t in kv_scales):
        _fail(name, "kv_scales must be contiguous")


def _check_scale(name: str, scale: float) -> None:
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        _fail(name, f"scale must be a positive finite float, got {scale!r}")


# --------------------------------------------------------------------------------------------
# One step's tensors
# --------------------------------------------------------------------------------------------


def _check_queries(name: str, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, kv_scales) -> None:
    """q [num_tokens, num_heads, head_dim] and ``out`` of its shape and dtype, on the cache's device, contiguous in
    their last dimension; a 16-bit cache in q's dtype."""
    if q.dim() != 3:
        _fail(name, f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        _fail(name, f"q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if q.dtype not in SUPPORTED_DTYPES:
        _fail(name, f"q dtype {q.dtype} is not supported (one of {SUPPORTED_DTYPES})")
    if kv_scales is None and k_cache.dtype != q.dtype:
        _fail(name, f"the cache's dtype ({k_cache.dtype}) must match q ({q.dtype})")
    if out.shape != q.shape or out.dtype != q.dtype:
        _fail(name, f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    for t_name, t in (("q", q), ("out", out)):
        if t.device != k_cache.device:
            _fail(name, f"{t_name} is on {t.device}, the cache on {k_cache.device}")
        if t.numel() > 0 and t.stride(-1) != 1:
            _fail(name, f"{t_name} must be contiguous in its last dimension, got strides {t.stride()}")


def _check_tables(name: str, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """block_tables [num_seqs, max_blocks] and seq_lens [num_seqs], int32, on q's device, contiguous rows."""
    num_seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        _fail(name, f"block_tables must be a 2-D int32 tensor, got {tuple(block_tables.shape)} {block_tables.dtype}")
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32:
        _fail(name, f"seq_lens must be int32 of shape ({num_seqs},), got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    for t_name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != q.device:
            _fail(name, f"{t_name} is on {t.device}, q on {q.device}")
        if t.numel() > 0 and t.stride(-1) != 1:
            _fail(name, f"{t_name} must be contiguous in its last dimension, got strides {t.stride()}")


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


def _check_write_rows(name: str, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None, slot_mapping: torch.Tensor,
                      k_cache: torch.Tensor, kv_scales) -> None:
    """k and v [>= num_slots, num_kv_heads, head_dim] with contiguous rows (in the cache's dtype unless it is FP8),
    int64 slots, q [>= num_slots, num_heads, head_dim] with contiguous rows; all on the cache's device."""
    row_shape = tuple(k_cache.shape[2:])
    num_tokens = slot_mapping.shape[0]
    for t_name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != row_shape or t.shape[0] < num_tokens:
            _fail(name, f"{t_name} must be [>= {num_tokens}, {row_shape[0]}, {row_shape[1]}], got {tuple(t.shape)}")
        if (t.dtype != k_cache.dtype and kv_scales is None) or t.device != k_cache.device:
            _fail(name, f"{t_name} is {t.dtype} on {t.device}, the cache {k_cache.dtype} on {k_cache.device}")
        if t.stride(2) != 1 or t.stride(1) != row_shape[1]:
            _fail(name, f"{t_name} rows must be contiguous (num_kv_heads * head_dim), got strides {t.stride()}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64 or slot_mapping.device != k_cache.device:
        _fail(name, f"slot_mapping must be 1-D int64 on {k_cache.device}, got {tuple(slot_mapping.shape)} "
                    f"{slot_mapping.dtype} on {slot_mapping.device}")
    if q is not None and (q.dim() != 3 or q.shape[0] < num_tokens or q.shape[2] != row_shape[1]
                          or q.stride(2) != 1 or q.device != k_cache.device):
        _fail(name, f"q must be [>= {num_tokens}, num_heads, {row_shape[1]}] on {k_cache.device} with contiguous "
                    f"rows, got {tuple(q.shape)} strides {q.stride()}")


def _check_write_rope(name: str, rope, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, kv_scales,
                      apart: bool) -> None:
    """The step's rope (``engine.models.rotary.PendingRope``) as the write applies it: with q, on k's dtype, its
    positions, tables, weights and column scales as the rope kernels take them, partial products of q|k|v on a
    16-bit cache only; ``apart``: an FP8 cache's rope kernel runs before the write, on k with q's rows."""
    if q is None:
        _fail(name, "rope needs q")
    if v.dtype != k.dtype:
        _fail(name, f"with rope, v must be k's dtype {k.dtype}, got {v.dtype}")
    if kv_scales is not None and rope.partials is not None:
        _fail(name, "partial products of q|k|v (a product cut along K) go to a 16-bit cache only")
    check_rope_inputs(name, rope.positions, q, k, rope.cos_sin_cache, rope.q_weight, rope.k_weight,
                      rope.mrope_section, rope.column_scales)
    if rope.partials is not None:
        check_partials(name, rope.partials, q, k, v)
    if kv_scales is not None and apart and k.shape[0] != q.shape[0]:
        _fail(name, f"with rope on an FP8 cache, k must have q's {q.shape[0]} rows, got {tuple(k.shape)}")
