"""The KV-cache write: the new tokens' K and V into their cache slots, and the queries the attention kernels must read
the cache with.

Given the layer's pending rope (``engine.models.rotary.PendingRope``), q and k arrive as the q|k|v projection left
them and the launch applies their rope (after Qwen3's per-head norm; M-RoPE too; an FP8 product's column scales
first), stores K roped in its slot and returns q roped. On a 16-bit cache that is one launch of the rope kernel
(``engine.ops.fused.launch_rope_into_cache``): one program per token for q, one for K and V. On an FP8 cache the
rope kernel runs first (with q's and k's column scales) and ``kv_write_fp8``'s kernel follows (V's scales), which
measured faster than that kernel roping K's and the queries' rows itself (``fuse_rope``; engaged up to
``_FP8_FUSED_ROPE_MAX_ROWS`` rows, none for now). The roundings are those of the separate rope kernel followed by
the plain write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.attention.kv_write_fp8 import _launch_write_fp8
from engine.ops.attention.launch import _FP8_FUSED_ROPE_MAX_ROWS
from engine.ops.fused import launch_rope, launch_rope_into_cache
from engine.ops.intmath import next_power_of_2
from kvcache.paged_cache import rotates_keys


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


def _launch_write(k, v, k_cache, v_cache, slot_mapping, kv_scales=None, q=None, rope=None, tokens_per_program=None,
                  split_queries=None, fuse_rope=None) -> torch.Tensor | None:
    """``write_paged_kv`` on checked arguments. ``tokens_per_program`` and ``split_queries`` (an FP8 cache) replace
    the launch's choices, for sweeps; ``fuse_rope`` (an FP8 cache with a rope) ropes q and K in the write kernel
    itself (None: up to ``_FP8_FUSED_ROPE_MAX_ROWS`` rows)."""
    if rope is not None and kv_scales is None:
        return launch_rope_into_cache(rope.positions, q, k, v, k_cache, v_cache, slot_mapping, rope.cos_sin_cache,
                                      rope.q_weight, rope.k_weight, rope.eps, rope.mrope_section, rope.column_scales,
                                      rope.partials)
    v_column_scales = None  # q|k|v's column scales when only V's are left to apply
    if rope is not None and not (fuse_rope if fuse_rope is not None else q.shape[0] <= _FP8_FUSED_ROPE_MAX_ROWS):
        # The rope kernel first (q's and k's column scales with it), then the write, which scales V: where fusing
        # them measured slower (_FP8_FUSED_ROPE_MAX_ROWS).
        q, k = launch_rope(rope.positions, q, k, rope.cos_sin_cache, rope.q_weight, rope.k_weight, rope.eps,
                           rope.mrope_section, rope.column_scales)
        v_column_scales, rope = rope.column_scales, None
    queries = q is not None and ((kv_scales is not None and rotates_keys(k_cache.shape[3])) or rope is not None)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if queries else q
    if kv_scales is not None:
        _launch_write_fp8(k, v, k_cache, v_cache, slot_mapping, kv_scales, q, q_out if queries else None, rope,
                          v_column_scales, tokens_per_program, split_queries)
        return q_out
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return q_out
    row = k_cache.shape[2] * k_cache.shape[3]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        ROW=row, ROW_PAD=next_power_of_2(row), num_warps=4,
    )
    return q_out
