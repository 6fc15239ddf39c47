"""Gluon (Triton's explicit-layout dialect) FP8 products for decode batch sizes on Hopper, measured against
cuBLAS's 1 x 128-scaled product (bench/RESULTS.md). The engine does not use them: at the batch sizes of a W1
decode step (~151 tokens) cuBLAS's is faster.

    python bench/fp8_wgmma.py                    # Llama-3.1-8B's projections at 1, 64, 128, 151, 255 tokens
    python bench/fp8_wgmma.py --batches 151 --layers gate_up

Needs a Hopper GPU and a Triton with Gluon (measured with 3.6).

``C = (X * x_scales) @ (W * w_scales)^T`` with X quantized per token and 128 columns and W per output channel
(``engine.models.fp8``). The scales change every 128 columns, so each group's product is accumulated on its own
and scaled into a float32 accumulator on the CUDA cores ("promotion"). cuBLAS's 1 x 128 kernels and a
``tl.dot`` kernel wait for a group's tensor-core product before scaling it. All three kernels here compute
tiles of C^T (weight rows on the MMA's M side, 64 a warpgroup; tokens on its N side), with TMA keeping
``STAGES`` groups of weights, activations and the activations' scales in flight:

* ``_fp8_wgmma_kernel`` (``WgmmaConfig``): one token tile a program; a group's ``wgmma`` is issued
  asynchronously and the previous group's finished product is scaled while it runs (``warpgroup_mma_wait(1)``).
  The group loop is unrolled by ``UNROLL``: an accumulator in flight carried around a loop makes ptxas
  serialize every wgmma (its C7514 message). Token tiles of one weight tile share its bytes through the L2.
* ``_fp8_wide_kernel`` (``WideConfig``, ``unroll`` 0): two token tiles a program (128 + 32 for 151 tokens),
  so that every weight byte passes the L2 once; the first tile's product is scaled while the second's runs.
* ``_fp8_pair_kernel`` (``WideConfig``, ``unroll`` > 0): the same tiles, the second tile's product also
  scaled while the next group's first runs.

Each configuration is timed in a CUDA graph on weight copies that do not fit the L2 (``fp8_gemm.graph_time``),
its output compared with cuBLAS's; the six fastest are printed with the first kernel's default pick.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_gemm import SHAPES, copies_needed, graph_time, weights  # noqa: E402

from engine.models import fp8
from engine.ops import fp8 as fp8_kernels  # noqa: E402

try:  # Gluon ships with recent Tritons only
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

GROUP = 128  # activation columns per scale, the K step


@dataclass(frozen=True)
class WgmmaConfig:
    """``block_w`` weight rows (64 a warpgroup) x ``block_t`` tokens a program, ``stages`` groups in flight, K cut
    into ``split`` parts summed by a second launch."""

    block_w: int
    block_t: int
    stages: int
    split: int = 1
    unroll: int = 4
    warps_t: int = 1  # warpgroups side by side along the tokens

    @property
    def num_warps(self) -> int:
        return self.block_w // 16 * self.warps_t


def default_config(num_rows: int, n: int, k: int, num_sms: int = 132) -> WgmmaConfig:
    block_t = min(64, max(16, triton.next_power_of_2(num_rows)))
    tiles = triton.cdiv(num_rows, block_t) * triton.cdiv(n, 64)
    split = 1
    while tiles * split < 2 * num_sms and k // GROUP // (split * 2) >= 8:
        split *= 2
    return WgmmaConfig(64, block_t, 4, split)


if gluon is not None:

    @gluon.jit
    def _fetch(w_desc, x_desc, xs_desc, w_smem, x_smem, xs_smem, ready, g, count, first, off_w, off_t,
               STAGES: gl.constexpr):
        """TMA loads of group ``g`` of this split (if ``g < count``) into its stage's buffers."""
        K_STEP: gl.constexpr = w_desc.block_type.shape[1]
        slot = g % STAGES
        bar = ready.index(slot)
        pred = g < count
        mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes + xs_desc.block_type.nbytes,
                        pred=pred)
        tma.async_copy_global_to_shared(w_desc, [off_w, (first + g) * K_STEP], bar, w_smem.index(slot), pred=pred)
        tma.async_copy_global_to_shared(x_desc, [off_t, (first + g) * K_STEP], bar, x_smem.index(slot), pred=pred)
        tma.async_copy_global_to_shared(xs_desc, [first + g, off_t], bar, xs_smem.index(slot), pred=pred)

    @gluon.jit(do_not_specialize=["num_rows", "groups_per_split"])
    def _fp8_wgmma_kernel(w_desc, x_desc, xs_desc, w_scale_ptr, out_ptr, num_rows, n, num_groups, groups_per_split,
                          stride_out, stride_split,
                          BLOCK_W: gl.constexpr, BLOCK_T: gl.constexpr, STAGES: gl.constexpr, UNROLL: gl.constexpr,
                          WARPS_T: gl.constexpr, num_warps: gl.constexpr):
        pid_t = gl.program_id(0)  # fastest: the token tiles of one weight tile run together
        pid_w = gl.program_id(1)
        pid_k = gl.program_id(2)
        off_t = pid_t * BLOCK_T
        off_w = pid_w * BLOCK_W
        first = pid_k * groups_per_split
        count = gl.minimum(groups_per_split, num_groups - first)
        K_STEP: gl.constexpr = w_desc.block_type.shape[1]  # one scale group

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps // WARPS_T, WARPS_T],
                                                      instr_shape=[16, BLOCK_T // WARPS_T, 32])
        rows_of: gl.constexpr = gl.SliceLayout(1, mma)
        cols_of: gl.constexpr = gl.SliceLayout(0, mma)

        # Each stage: a group's weight tile, activation tile and the activations' scales for it (token-major).
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_W, K_STEP], w_desc.layout)
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_T, K_STEP], x_desc.layout)
        xs_smem = gl.allocate_shared_memory(xs_desc.dtype, [STAGES] + xs_desc.block_type.shape, xs_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)

        # Whole iterations of UNROLL groups; the last split's groups past K load as zeros (TMA fills them).
        padded = gl.cdiv(count, UNROLL) * UNROLL
        for i in gl.static_range(STAGES):
            _fetch(w_desc, x_desc, xs_desc, w_smem, x_smem, xs_smem, ready, i, padded, first, off_w, off_t, STAGES)

        zero = gl.zeros([BLOCK_W, BLOCK_T], gl.float32, layout=mma)
        acc = gl.zeros([BLOCK_W, BLOCK_T], gl.float32, layout=mma)
        for start in range(0, padded, UNROLL):
            # Unrolled, so that no accumulator in flight is carried around a loop (ptxas then serializes every
            # wgmma). Each group's product starts, then the one before it, finished, is scaled while it runs.
            prev_scale, prev = _issue(w_smem, x_smem, xs_smem, ready, start, zero, mma, STAGES, True)
            for j in gl.static_range(1, UNROLL):
                scale, cur = _issue(w_smem, x_smem, xs_smem, ready, start + j, zero, mma, STAGES, True)
                acc += warpgroup_mma_wait(num_outstanding=1, deps=(prev,)) * prev_scale
                # The finished group's buffers are free: fetch the group STAGES after it into them.
                _fetch(w_desc, x_desc, xs_desc, w_smem, x_smem, xs_smem, ready, start + j - 1 + STAGES, padded,
                       first, off_w, off_t, STAGES)
                prev, prev_scale = cur, scale
            acc += warpgroup_mma_wait(num_outstanding=0, deps=(prev,)) * prev_scale
            _fetch(w_desc, x_desc, xs_desc, w_smem, x_smem, xs_smem, ready, start + UNROLL - 1 + STAGES, padded,
                   first, off_w, off_t, STAGES)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        rows = off_w + gl.arange(0, BLOCK_W, layout=rows_of)
        tokens = off_t + gl.arange(0, BLOCK_T, layout=cols_of)
        row_mask = rows < n
        acc = acc * gl.load(w_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
        ptrs = out_ptr + pid_k * stride_split + tokens[None, :] * stride_out + rows[:, None]
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (tokens < num_rows)[None, :])


    @gluon.jit
    def _fetch_wide(w_desc, xa_desc, xb_desc, sa_desc, sb_desc, w_smem, xa_smem, xb_smem, sa_smem, sb_smem, ready,
                    g, count, first, off_w, off_t, HAS_B: gl.constexpr, STAGES: gl.constexpr):
        """TMA loads of group ``g`` (if ``g < count``): the weight tile, both token tiles and their scales."""
        K_STEP: gl.constexpr = w_desc.block_type.shape[1]
        TILE_A: gl.constexpr = xa_desc.block_type.shape[0]
        slot = g % STAGES
        bar = ready.index(slot)
        pred = g < count
        k0 = (first + g) * K_STEP
        nbytes: gl.constexpr = w_desc.block_type.nbytes + xa_desc.block_type.nbytes + sa_desc.block_type.nbytes
        if HAS_B:
            mbarrier.expect(bar, nbytes + xb_desc.block_type.nbytes + sb_desc.block_type.nbytes, pred=pred)
        else:
            mbarrier.expect(bar, nbytes, pred=pred)
        tma.async_copy_global_to_shared(w_desc, [off_w, k0], bar, w_smem.index(slot), pred=pred)
        tma.async_copy_global_to_shared(xa_desc, [off_t, k0], bar, xa_smem.index(slot), pred=pred)
        tma.async_copy_global_to_shared(sa_desc, [first + g, off_t], bar, sa_smem.index(slot), pred=pred)
        if HAS_B:
            tma.async_copy_global_to_shared(xb_desc, [off_t + TILE_A, k0], bar, xb_smem.index(slot), pred=pred)
            tma.async_copy_global_to_shared(sb_desc, [first + g, off_t + TILE_A], bar, sb_smem.index(slot),
                                            pred=pred)

    @gluon.constexpr_function
    def _mma_layout(num_warps, tokens):
        """The wgmma accumulator's layout for 64 weight rows a warpgroup x ``tokens``."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, tokens, 32])

    @gluon.jit
    def _start_wide(w_desc, xa_desc, xb_desc, sa_desc, sb_desc, num_groups, groups_per_split, UNROLL: gl.constexpr,
                    HAS_B: gl.constexpr, STAGES: gl.constexpr):
        """The two-tile kernels' program: (first token, first weight row, split, its first group, its groups
        rounded up to whole ``UNROLL``s, the buffers w, xa, xb, sa, sb and their barriers), the first ``STAGES``
        groups requested.
        Without ``HAS_B`` the second tile's buffers are the first's."""
        TILE_A: gl.constexpr = xa_desc.block_type.shape[0]
        TILE_B: gl.constexpr = xb_desc.block_type.shape[0]
        pid_t = gl.program_id(0)
        pid_w = gl.program_id(1)
        pid_k = gl.program_id(2)
        off_t = pid_t * TILE_A
        if HAS_B:
            off_t = pid_t * (TILE_A + TILE_B)
        off_w = pid_w * w_desc.block_type.shape[0]
        first = pid_k * groups_per_split
        count = gl.cdiv(gl.minimum(groups_per_split, num_groups - first), UNROLL) * UNROLL
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        xa_smem = gl.allocate_shared_memory(xa_desc.dtype, [STAGES] + xa_desc.block_type.shape, xa_desc.layout)
        sa_smem = gl.allocate_shared_memory(sa_desc.dtype, [STAGES] + sa_desc.block_type.shape, sa_desc.layout)
        if HAS_B:
            xb_smem = gl.allocate_shared_memory(xb_desc.dtype, [STAGES] + xb_desc.block_type.shape, xb_desc.layout)
            sb_smem = gl.allocate_shared_memory(sb_desc.dtype, [STAGES] + sb_desc.block_type.shape, sb_desc.layout)
        else:
            xb_smem = xa_smem
            sb_smem = sa_smem
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(STAGES):
            _fetch_wide(w_desc, xa_desc, xb_desc, sa_desc, sb_desc, w_smem, xa_smem, xb_smem, sa_smem, sb_smem,
                        ready, i, count, first, off_w, off_t, HAS_B, STAGES)
        return off_t, off_w, pid_k, first, count, w_smem, xa_smem, xb_smem, sa_smem, sb_smem, ready

    @gluon.jit
    def _store_tile(acc, w_scale_ptr, out_ptr, off_w, off_t, num_rows, n, stride_out, mma: gl.constexpr):
        rows = off_w + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, mma))
        tokens = off_t + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, mma))
        row_mask = rows < n
        acc = acc * gl.load(w_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
        ptrs = out_ptr + tokens[None, :] * stride_out + rows[:, None]
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (tokens < num_rows)[None, :])

    @gluon.jit(do_not_specialize=["num_rows", "groups_per_split"])
    def _fp8_wide_kernel(w_desc, xa_desc, xb_desc, sa_desc, sb_desc, w_scale_ptr, out_ptr, num_rows, n, num_groups,
                         groups_per_split, stride_out, stride_split,
                         HAS_B: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """Two token tiles a program (e.g. 128 + 32 for 151 tokens), so that each weight byte passes the L2 once;
        each group: both products issued, the first scaled while the second runs, then the second."""
        BLOCK_W: gl.constexpr = w_desc.block_type.shape[0]
        TILE_A: gl.constexpr = xa_desc.block_type.shape[0]
        TILE_B: gl.constexpr = xb_desc.block_type.shape[0]
        mma_a: gl.constexpr = _mma_layout(num_warps, TILE_A)
        mma_b: gl.constexpr = _mma_layout(num_warps, TILE_B)
        off_t, off_w, pid_k, first, count, w_smem, xa_smem, xb_smem, sa_smem, sb_smem, ready = _start_wide(
            w_desc, xa_desc, xb_desc, sa_desc, sb_desc, num_groups, groups_per_split, 1, HAS_B, STAGES)

        zero_a = gl.zeros([BLOCK_W, TILE_A], gl.float32, layout=mma_a)
        acc_a = gl.zeros([BLOCK_W, TILE_A], gl.float32, layout=mma_a)
        zero_b = gl.zeros([BLOCK_W, TILE_B], gl.float32, layout=mma_b)
        acc_b = gl.zeros([BLOCK_W, TILE_B], gl.float32, layout=mma_b)
        for g in range(count):
            slot = g % STAGES
            mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
            scale_a = sa_smem.index(slot).slice(0, TILE_A, dim=1).load(mma_a)
            a = warpgroup_mma(w_smem.index(slot), xa_smem.index(slot).permute((1, 0)), zero_a, use_acc=False,
                              is_async=True)
            if HAS_B:
                scale_b = sb_smem.index(slot).slice(0, TILE_B, dim=1).load(mma_b)
                b = warpgroup_mma(w_smem.index(slot), xb_smem.index(slot).permute((1, 0)), zero_b, use_acc=False,
                                  is_async=True)
                acc_a += warpgroup_mma_wait(num_outstanding=1, deps=(a,)) * scale_a
                acc_b += warpgroup_mma_wait(num_outstanding=0, deps=(b,)) * scale_b
            else:
                acc_a += warpgroup_mma_wait(num_outstanding=0, deps=(a,)) * scale_a
            _fetch_wide(w_desc, xa_desc, xb_desc, sa_desc, sb_desc, w_smem, xa_smem, xb_smem, sa_smem, sb_smem,
                        ready, g + STAGES, count, first, off_w, off_t, HAS_B, STAGES)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
        out_ptr += pid_k * stride_split
        _store_tile(acc_a, w_scale_ptr, out_ptr, off_w, off_t, num_rows, n, stride_out, mma_a)
        if HAS_B:
            _store_tile(acc_b, w_scale_ptr, out_ptr, off_w, off_t + TILE_A, num_rows, n, stride_out, mma_b)


    @gluon.jit
    def _issue(w_smem, x_smem, s_smem, ready, g, reuse, mma: gl.constexpr, STAGES: gl.constexpr,
                    WAIT: gl.constexpr):
        """Start group ``g``'s product of one token tile (waiting for its operands first if ``WAIT``), written
        into ``reuse``'s registers (zeros, or a finished product no longer needed): (the activations' scales
        [1, tokens], the product in flight)."""
        slot = g % STAGES
        if WAIT:
            mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        scale = s_smem.index(slot).slice(0, reuse.shape[1], dim=1).load(mma)
        product = warpgroup_mma(w_smem.index(slot), x_smem.index(slot).permute((1, 0)), reuse, use_acc=False,
                                is_async=True)
        return scale, product

    @gluon.jit(do_not_specialize=["num_rows", "groups_per_split"])
    def _fp8_pair_kernel(w_desc, xa_desc, xb_desc, sa_desc, sb_desc, w_scale_ptr, out_ptr, num_rows, n, num_groups,
                         groups_per_split, stride_out, stride_split,
                         STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr):
        """``_fp8_wide_kernel`` with the promotions overlapped: group g's first tile is scaled while its second
        runs, and the second while group g + 1's first runs (unrolled by ``UNROLL`` groups, nothing in flight
        around the loop)."""
        BLOCK_W: gl.constexpr = w_desc.block_type.shape[0]
        TILE_A: gl.constexpr = xa_desc.block_type.shape[0]
        TILE_B: gl.constexpr = xb_desc.block_type.shape[0]
        mma_a: gl.constexpr = _mma_layout(num_warps, TILE_A)
        mma_b: gl.constexpr = _mma_layout(num_warps, TILE_B)
        # The last split's groups past K (up to whole unrolled iterations) load as zeros.
        off_t, off_w, pid_k, first, padded, w_smem, xa_smem, xb_smem, sa_smem, sb_smem, ready = _start_wide(
            w_desc, xa_desc, xb_desc, sa_desc, sb_desc, num_groups, groups_per_split, UNROLL, True, STAGES)

        acc_a = gl.zeros([BLOCK_W, TILE_A], gl.float32, layout=mma_a)
        acc_b = gl.zeros([BLOCK_W, TILE_B], gl.float32, layout=mma_b)
        done_a = gl.zeros([BLOCK_W, TILE_A], gl.float32, layout=mma_a)
        done_b = gl.zeros([BLOCK_W, TILE_B], gl.float32, layout=mma_b)
        for start in range(0, padded, UNROLL):
            scale_a, a = _issue(w_smem, xa_smem, sa_smem, ready, start, done_a, mma_a, STAGES, True)
            scale_b, b = _issue(w_smem, xb_smem, sb_smem, ready, start, done_b, mma_b, STAGES, False)
            done_a = warpgroup_mma_wait(num_outstanding=1, deps=(a,))
            acc_a += done_a * scale_a
            for j in gl.static_range(1, UNROLL):
                scale_a, a = _issue(w_smem, xa_smem, sa_smem, ready, start + j, done_a, mma_a, STAGES, True)
                done_b = warpgroup_mma_wait(num_outstanding=1, deps=(b,))
                acc_b += done_b * scale_b
                # Both tiles of the group before are finished: its buffers take the group STAGES after it.
                _fetch_wide(w_desc, xa_desc, xb_desc, sa_desc, sb_desc, w_smem, xa_smem, xb_smem, sa_smem, sb_smem,
                            ready, start + j - 1 + STAGES, padded, first, off_w, off_t, True, STAGES)
                scale_b, b = _issue(w_smem, xb_smem, sb_smem, ready, start + j, done_b, mma_b, STAGES, False)
                done_a = warpgroup_mma_wait(num_outstanding=1, deps=(a,))
                acc_a += done_a * scale_a
            done_b = warpgroup_mma_wait(num_outstanding=0, deps=(b,))
            acc_b += done_b * scale_b
            _fetch_wide(w_desc, xa_desc, xb_desc, sa_desc, sb_desc, w_smem, xa_smem, xb_smem, sa_smem, sb_smem,
                        ready, start + UNROLL - 1 + STAGES, padded, first, off_w, off_t, True, STAGES)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
        out_ptr += pid_k * stride_split
        _store_tile(acc_a, w_scale_ptr, out_ptr, off_w, off_t, num_rows, n, stride_out, mma_a)
        _store_tile(acc_b, w_scale_ptr, out_ptr, off_w, off_t + TILE_A, num_rows, n, stride_out, mma_b)


@dataclass(frozen=True)
class WideConfig:
    """``block_w`` weight rows (64 a warpgroup) x ``tile_a`` + ``tile_b`` tokens a program (``tile_b`` 0: one
    token tile), ``stages`` groups in flight, K cut into ``split`` parts."""

    block_w: int
    tile_a: int
    tile_b: int
    stages: int
    split: int = 1
    unroll: int = 0  # > 0: _fp8_pair_kernel, that many groups unrolled


def fp8_wide(xq: torch.Tensor, x_scales: torch.Tensor, num_rows: int, weight: torch.Tensor, w_scales: torch.Tensor,
             out_dtype: torch.dtype, cfg: WideConfig) -> torch.Tensor:
    """``fp8_wgmma``'s product through ``_fp8_wide_kernel``."""
    n, k = weight.shape
    rows = xq.shape[0]
    if k % GROUP or xq.shape[1] != k or rows % 4 or x_scales.stride() != (1, rows):
        raise ValueError("fp8_wide: operands not in the engine's quantized layout")
    out = torch.empty((num_rows, n), dtype=out_dtype, device=xq.device)
    groups = k // GROUP
    groups_per_split = triton.cdiv(groups, cfg.split)
    if cfg.unroll:  # every split but the last takes whole unrolled iterations
        groups_per_split = triton.cdiv(groups_per_split, cfg.unroll) * cfg.unroll
    split = triton.cdiv(groups, groups_per_split)
    target = out if split == 1 else torch.empty((split, num_rows, n), dtype=torch.float32, device=xq.device)

    def desc(t, box, dtype):
        return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, dtype))

    w_desc = desc(weight, [cfg.block_w, GROUP], gl.float8e4nv)
    xa_desc = desc(xq, [cfg.tile_a, GROUP], gl.float8e4nv)
    sa_desc = desc(x_scales.t(), [1, max(cfg.tile_a, 32)], gl.float32)
    has_b = cfg.tile_b > 0
    xb_desc = desc(xq, [cfg.tile_b, GROUP], gl.float8e4nv) if has_b else xa_desc
    sb_desc = desc(x_scales.t(), [1, max(cfg.tile_b, 32)], gl.float32) if has_b else sa_desc
    grid = (triton.cdiv(num_rows, cfg.tile_a + cfg.tile_b), triton.cdiv(n, cfg.block_w), split)
    if cfg.unroll and has_b:
        _fp8_pair_kernel[grid](w_desc, xa_desc, xb_desc, sa_desc, sb_desc, w_scales, target, num_rows, n, groups,
                               groups_per_split, n, num_rows * n, STAGES=cfg.stages, UNROLL=cfg.unroll,
                               num_warps=cfg.block_w // 16)
    else:
        _fp8_wide_kernel[grid](w_desc, xa_desc, xb_desc, sa_desc, sb_desc, w_scales, target, num_rows, n, groups,
                               groups_per_split, n, num_rows * n, HAS_B=has_b, STAGES=cfg.stages,
                               num_warps=cfg.block_w // 16)
    if split > 1:
        fp8_kernels.sum_splits(target, out)
    return out


def fp8_wgmma(xq: torch.Tensor, x_scales: torch.Tensor, num_rows: int, weight: torch.Tensor,
              w_scales: torch.Tensor, out_dtype: torch.dtype, config: WgmmaConfig | None = None) -> torch.Tensor:
    """xq [rows, k] float8 (rows >= ``num_rows``, a multiple of 4; padding rows are never stored) with scales
    [rows, k / 128] stored token-major (the transposed view ``empty_quantized(cublas_layout=True)`` makes),
    weight [n, k] float8 with per-channel scales [n] -> [num_rows, n] in ``out_dtype``."""
    n, k = weight.shape
    rows = xq.shape[0]
    if k % GROUP or xq.shape[1] != k or rows % 4:
        raise ValueError(f"fp8_wgmma: K {k} must be a multiple of {GROUP} and match the activations' "
                         f"{xq.shape[1]}, their rows ({rows}) a multiple of 4")
    if x_scales.shape != (rows, k // GROUP) or x_scales.stride() != (1, rows):
        raise ValueError(f"fp8_wgmma: activation scales {tuple(x_scales.shape)} with strides {x_scales.stride()}, "
                         f"expected ({rows}, {k // GROUP}) token-major")
    cfg = config or default_config(num_rows, n, k, torch.cuda.get_device_properties(xq.device).multi_processor_count)
    out = torch.empty((num_rows, n), dtype=out_dtype, device=xq.device)
    if not num_rows:
        return out
    groups = k // GROUP
    # Every split but the last takes whole unrolled iterations; the last one's extra groups lie past K.
    groups_per_split = triton.cdiv(triton.cdiv(groups, cfg.split), cfg.unroll) * cfg.unroll
    split = triton.cdiv(groups, groups_per_split)
    target = out if split == 1 else torch.empty((split, num_rows, n), dtype=torch.float32, device=xq.device)
    w_desc = TensorDescriptor.from_tensor(
        weight, [cfg.block_w, GROUP], gl.NVMMASharedLayout.get_default_for([cfg.block_w, GROUP], gl.float8e4nv))
    x_desc = TensorDescriptor.from_tensor(
        xq, [cfg.block_t, GROUP], gl.NVMMASharedLayout.get_default_for([cfg.block_t, GROUP], gl.float8e4nv))
    xs_box = [1, max(cfg.block_t, 32)]  # whole 128-byte rows, so that every stage's TMA target stays aligned
    xs_desc = TensorDescriptor.from_tensor(x_scales.t(), xs_box,
                                           gl.NVMMASharedLayout.get_default_for(xs_box, gl.float32))
    grid = (triton.cdiv(num_rows, cfg.block_t), triton.cdiv(n, cfg.block_w), split)
    _fp8_wgmma_kernel[grid](w_desc, x_desc, xs_desc, w_scales, target, num_rows, n, groups, groups_per_split,
                            n, num_rows * n, BLOCK_W=cfg.block_w, BLOCK_T=cfg.block_t, STAGES=cfg.stages,
                            UNROLL=cfg.unroll, WARPS_T=cfg.warps_t, num_warps=cfg.num_warps)
    if split > 1:
        fp8_kernels.sum_splits(target, out)
    return out


def products(shape: str, batches, layers, first_call):
    """(name, n, k, weight copies, tokens, quantized activations, their scales) for each projection and token
    count, after ``first_call(xq, xs, m, weight)`` ran once: a fault there stops the sweep (every later call
    would report it)."""
    for name, (n, k) in SHAPES[shape].items():
        if layers and name not in layers:
            continue
        ws = weights(n, k, copies_needed(n, k))
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = fp8_kernels.quantize_rows(x, fp8.ACTIVATION_GROUP, cublas_layout=True)
            first_call(xq, xs, m, ws[0])
            torch.cuda.synchronize()
            yield name, n, k, ws, m, xq, xs
        del ws
        torch.cuda.empty_cache()


def sweep(shape: str, batches, layers) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    first = lambda xq, xs, m, w: fp8_wgmma(xq, xs, m, w["values"], w["scales"], torch.bfloat16)  # noqa: E731
    for name, n, k, ws, m, xq, xs in products(shape, batches, layers, first):
        want = torch._scaled_mm(xq, ws[0]["values"].t(), scale_a=xs, scale_b=ws[0]["cublas"].groups,
                                out_dtype=torch.bfloat16)[:m].float()
        cublas = graph_time([lambda w=w: torch._scaled_mm(xq, w["values"].t(), scale_a=xs,
                                                           scale_b=w["cublas"].groups, out_dtype=torch.bfloat16)
                             for w in ws])
        configs = [WgmmaConfig(bw, bt, stages, split, 4) for bw, bt, stages, split in
                   itertools.product((64, 128), (16, 32, 64), (3, 4), (1, 2, 4))]
        configs += [WgmmaConfig(bw, bt, stages, split, 4, warps_t)
                    for bw, bt, warps_t in ((64, 128, 2), (64, 256, 2), (64, 256, 4), (128, 128, 2), (128, 128, 1))
                    for stages in (2, 3) for split in (1, 2)]
        configs = [c for c in configs
                   if c.block_t <= max(16, 2 * triton.next_power_of_2(m)) and k // GROUP // c.split >= c.unroll]
        wide = itertools.product((64, 128), (16, 32, 64, 128), (0, 16, 32, 64), (3, 4), (1, 2, 4), (0, 2, 4))
        configs += [WideConfig(bw, ta, tb, stages, split, unroll)
                    for bw, ta, tb, stages, split, unroll in wide if tb or not unroll
                    if (tb == 0 or tb < ta) and ta <= max(16, triton.next_power_of_2(m)) and ta + tb >= min(m, 128)
                    and not (tb and ta + tb - m >= tb) and k // GROUP // split >= max(4, unroll)]
        results = time_configs(configs, lambda cfg: fp8_wide if isinstance(cfg, WideConfig) else fp8_wgmma,
                               xq, xs, m, ws, want)
        pick = default_config(m, n, k, num_sms)
        picked = next((f"{t:.1f} us" for t, c, _ in results if c == pick), "not run")
        print(f"{name} m={m}: cuBLAS 1x128 {cublas:.1f} us ({n * k / (cublas * 1e-6) / 1e12:.2f} TB/s); "
              f"default {pick} -> {picked}")
        for t, cfg, error in results[:6]:
            print(f"    {t:7.1f} us {n * k / (t * 1e-6) / 1e12:5.2f} TB/s {cublas / t:5.2f}x  {cfg}  "
                  f"error against cuBLAS {error:.1e}", flush=True)


def time_configs(configs, product_for, xq, xs, m, ws, want) -> list:
    """[(us, config, relative error against ``want``)] of ``product_for(config)(xq, xs, m, weight, scales, bf16,
    config)`` for each config that compiles and runs, fastest first."""
    results = []
    for cfg in configs:
        product = product_for(cfg)
        try:
            got = product(xq, xs, m, ws[0]["values"], ws[0]["scales"], torch.bfloat16, cfg).float()
            error = float((got - want).norm() / want.norm())
            t = graph_time([lambda w=w, cfg=cfg, fn=product: fn(xq, xs, m, w["values"], w["scales"], torch.bfloat16,
                                                                cfg) for w in ws], reps=3)
        except Exception as exc:  # out of shared memory or registers for this tile
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        results.append((t, cfg, error))
    return sorted(results, key=lambda r: r[0])


def cli(doc: str, default_batches: str, run) -> None:
    """The command line of this script and bench/fp8_prefill_wgmma.py: ``run(shape, batches, layers)``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default=default_batches, help="comma-separated token counts")
    parser.add_argument("--layers", default="", help="comma-separated projections (default: all)")
    args = parser.parse_args()
    if gluon is None:
        raise SystemExit("this Triton has no Gluon")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    run(args.shape, tuple(int(b) for b in args.batches.split(",")), tuple(filter(None, args.layers.split(","))))


def main() -> None:
    cli(__doc__, "1,64,128,151,255", sweep)


if __name__ == "__main__":
    main()
