"""Triton kernels of the FP8 linear layers (``engine.models.fp8``): activation quantization and the
block-scaled matmul of FP8 checkpoints.

* ``quantize_rows``: each token's activation row (or each ``group`` columns of it) scaled so that its
  absolute maximum maps to 448 and rounded to float8_e4m3, in one launch (one program per row and group).
* ``block_scaled_matmul``: ``C = (A * a_scales) @ (W * w_scales)^T`` with A quantized per (row, 128
  columns) and W per 128 x 128 tile: each K step multiplies one FP8 tile pair on the tensor cores and adds
  it to the float32 accumulator times the row scales of A and the tile scale of W.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcache.paged_cache import FP8_DTYPE



@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, num_cols, group_size, num_groups, stride_x, stride_q,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * group_size
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for off in range(0, group_size, BLOCK):
        cols = start + off + offs
        mask = (off + offs < group_size) & (cols < num_cols)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1.1754943508222875e-38)
    for off in range(0, group_size, BLOCK):
        cols = start + off + offs
        mask = (off + offs < group_size) & (cols < num_cols)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + cols, (x / scale).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * num_groups + g, scale)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (float8 [m, k], float32 scales [m, 1] or [m, ceil(k / group)]); see ``fp8.quantize_rows``."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows: x must be a 2-D tensor contiguous in its rows, got {tuple(x.shape)}")
    m, k = x.shape
    group_size = k if group is None else group
    num_groups = triton.cdiv(k, group_size)
    values = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(group_size), 1024)
        _quantize_rows_kernel[(m, num_groups)](x, values, scales, k, group_size, num_groups, x.stride(0),
                                               values.stride(0), BLOCK=block, num_warps=4)
    return values, scales


@triton.jit
def _block_scaled_matmul_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, c_ptr, M, N, K,
                                stride_am, stride_wn, stride_cm, stride_asm, stride_wsn,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                W_BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        k_mask = k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]: W^T's tile
        a_s = tl.load(a_scale_ptr + offs_m * stride_asm + kb, mask=m_mask, other=0.0)
        w_s = tl.load(w_scale_ptr + (offs_n // W_BLOCK_N) * stride_wsn + kb, mask=n_mask, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def block_scaled_matmul(a: torch.Tensor, a_scales: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor,
                        block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a [m, k] float8 with scales [m, ceil(k / block[1])], weight [n, k] float8 with scales
    [ceil(n / block[0]), ceil(k / block[1])] -> [m, n] in ``out_dtype``."""
    m, k = a.shape
    n = weight.shape[0]
    bn, bk = block
    if bk not in (64, 128, 256) or bn % 16:
        raise ValueError(f"block_scaled_matmul: weight blocks of {block} are not supported")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = min(128, bn) if bn <= 128 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_scaled_matmul_kernel[grid](a, a_scales, weight, w_scales, out, m, n, k,
                                      a.stride(0), weight.stride(0), out.stride(0), a_scales.stride(0),
                                      w_scales.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
                                      W_BLOCK_N=bn, num_warps=4, num_stages=3)
    return out
