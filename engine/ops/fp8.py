"""Triton kernels of the FP8 linear layers (``engine.models.fp8``): activation quantization and the scaled
FP8 matmul.

* ``quantize_rows``: each token's activation row (or each ``group`` columns of it) scaled so that its
  absolute maximum maps to 448 and rounded to float8_e4m3, in one launch (one program per row and group).
* ``scaled_matmul``: ``C = (A * a_scales) @ (W * w_scales)^T`` with A quantized per (row, 128 columns) and
  W per output row (``--quantization fp8``) or per 128 x 128 tile (FP8 checkpoints). Each K step multiplies
  one FP8 tile pair on the tensor cores and adds it to the float32 accumulator times the activations' group
  scales (and the tile's weight scale); per-row weight scales multiply the result once. The kernel computes
  C^T, so a decode step's few tokens sit on the tensor cores' narrow side; at decode batch sizes K is split
  until every SM streams its part of the weights, and a second launch sums the parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.intmath import cdiv, next_power_of_2
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


@triton.jit(do_not_specialize=["num_rows", "stride_s", "stride_sg"])
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, num_rows, num_cols, num_groups, stride_x, stride_q, stride_s,
                            stride_sg, GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr):
    """``GROUPS_PER_PROGRAM`` groups of one row, read once: [groups, GROUP] values, one scale per group. Rows
    past ``num_rows`` (padding) become zeros."""
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (groups[:, None] < num_groups) & (cols < num_cols)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask & (row < num_rows), other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / 448.0, 1.1754943508222875e-38)
    tl.store(q_ptr + row * stride_q + cols, (x / scale[:, None]).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + groups * stride_sg, scale, mask=groups < num_groups)


def empty_quantized(m: int, k: int, group: int, device: torch.device,
                    cublas_layout: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for ``m`` rows of ``k`` quantized activations: float8 values and float32 scales, one per row and
    ``group`` columns; with ``cublas_layout`` the rows padded to a multiple of 4 and the scales a transposed
    view (token-major), as cuBLAS's 1 x 128 block scaling takes them."""
    num_groups = cdiv(k, group)
    rows = -(-m // 4) * 4 if cublas_layout else m
    values = torch.empty((rows, k), dtype=FP8_DTYPE, device=device)
    if cublas_layout:
        return values, torch.empty((num_groups, rows), dtype=torch.float32, device=device).t()
    return values, torch.empty((rows, num_groups), dtype=torch.float32, device=device)


def quantize_rows(x: torch.Tensor, group: int | None = None,
                  cublas_layout: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (float8 [m, k], float32 scales [m, 1] or [m, ceil(k / group)]); see ``fp8.quantize_rows``.

    ``cublas_layout`` (with a group): what cuBLAS's 1 x 128 block scaling takes, the rows padded with zeros to
    a multiple of 4 and the scales stored token-major (a transposed view)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows: x must be a 2-D tensor contiguous in its rows, got {tuple(x.shape)}")
    m, k = x.shape
    group_size = k if group is None else group
    num_groups = cdiv(k, group_size)
    values, scales = empty_quantized(m, k, group_size, x.device, cublas_layout)
    rows = values.shape[0]
    if not m:
        return values, scales
    if group is not None and group == next_power_of_2(group) and group <= 1024:
        per_program = max(1, min(next_power_of_2(num_groups), 2048 // group))
        _quantize_groups_kernel[(rows, cdiv(num_groups, per_program))](
            x, values, scales, m, k, num_groups, x.stride(0), values.stride(0), scales.stride(0), scales.stride(1),
            GROUP=group, GROUPS_PER_PROGRAM=per_program, num_warps=4)
    elif cublas_layout:
        raise ValueError("quantize_rows: the cuBLAS layout needs a power-of-two group")
    else:
        block = min(next_power_of_2(group_size), 1024)
        _quantize_rows_kernel[(m, num_groups)](x, values, scales, k, group_size, num_groups, x.stride(0),
                                               values.stride(0), BLOCK=block, num_warps=4)
    return values, scales


# The token count and what follows from it change every step: not specialized, so no step compiles a variant.
@triton.jit(do_not_specialize=["M", "groups_per_split", "stride_cs"])
def _scaled_matmul_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, c_ptr, M, N, K, groups_per_split,
                          stride_am, stride_wn, stride_cm, stride_cs, stride_asm, stride_wsn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          W_BLOCK_N: tl.constexpr):
    """One [BLOCK_N, BLOCK_M] tile of C^T = W @ A^T over one split of K (the weight rows fill the tensor cores'
    wide side, the few tokens of a decode step the narrow one). Each BLOCK_K step is one activation scale group;
    ``W_BLOCK_N`` > 0 means block weight scales (one per W_BLOCK_N rows x BLOCK_K columns), 0 one per row."""
    pid_m = tl.program_id(0)  # fastest: the programs that read one weight tile run together
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # A split starts on a group: a multiple of BLOCK_K that Triton can see, so the loads stay 16-byte vectors.
    k_begin = pid_k * groups_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + groups_per_split * BLOCK_K, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        a = tl.load(a_ptr + offs_m[None, :] * stride_am + k[:, None], mask=k_mask[:, None] & m_mask[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_M]: A^T's tile
        group = k0 // BLOCK_K
        scales = tl.load(a_scale_ptr + offs_m * stride_asm + group, mask=m_mask, other=0.0)[None, :]
        if W_BLOCK_N > 0:
            scales = scales * tl.load(w_scale_ptr + (offs_n // W_BLOCK_N) * stride_wsn + group, mask=n_mask,
                                      other=0.0)[:, None]
        acc += tl.dot(w, a) * scales  # each group's product is waited for before it is scaled (see RESULTS)
    if W_BLOCK_N == 0:
        acc *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    out_ptrs = c_ptr + pid_k * stride_cs + offs_m[None, :] * stride_cm + offs_n[:, None]
    tl.store(out_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit(do_not_specialize=["numel", "splits", "stride_s"])
def _sum_splits_kernel(part_ptr, c_ptr, numel, splits, stride_s, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * stride_s + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


GROUP = 128  # activation columns per scale; also the K step, and the column size of block weight scales


@dataclass(frozen=True)
class MatmulConfig:
    """Tiles of ``scaled_matmul``: BLOCK_M tokens x BLOCK_N weight rows per program, K cut into ``split``
    parts summed by a second launch."""

    block_m: int
    block_n: int
    split: int
    num_warps: int
    num_stages: int


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def matmul_config(m: int, n: int, k: int, num_sms: int) -> MatmulConfig:
    """Tiles for one product, from a sweep over Llama-3.1-8B's projections on an H200 (bench/fp8_gemm.py --sweep).

    Decode batches read weights: a narrow token tile, 64 or 128 weight rows, and K split in two, four or eight
    until about two programs per SM stream their share. Prefill batches are bound by the tensor cores."""
    if m > 256:
        return MatmulConfig(64, 128, 1, 4, 3)
    if m <= 64:
        block_m, block_n = max(16, next_power_of_2(m)), 64
    else:
        block_m, block_n = 32, 128
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    groups = cdiv(k, GROUP)
    split = 1
    while tiles * split < 1.8 * num_sms and groups // (split * 2) >= 4:
        split *= 2
    return MatmulConfig(block_m, block_n, split, 4, 3)


def scaled_matmul(a: torch.Tensor, a_scales: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor,
                  block: tuple[int, int] | None, out_dtype: torch.dtype,
                  config: MatmulConfig | None = None) -> torch.Tensor:
    """a [m, k] float8 with scales [m, ceil(k / 128)] (``quantize_rows(x, 128)``), weight [n, k] float8 with
    scales [n] (``block`` None) or [ceil(n / block[0]), ceil(k / 128)] (``block`` = (rows, 128)) -> [m, n]
    in ``out_dtype``, accumulated in float32."""
    m, k = a.shape
    n = weight.shape[0]
    if block is not None and (block[1] != GROUP or block[0] % 16):
        raise ValueError(f"scaled_matmul: weight blocks of {block} are not supported (columns must be {GROUP})")
    if a_scales.shape != (m, cdiv(k, GROUP)) or a_scales.stride(1) != 1:
        raise ValueError(f"scaled_matmul: activation scales {tuple(a_scales.shape)}, expected one per row and "
                         f"{GROUP} columns {(m, cdiv(k, GROUP))}")
    cfg = config or matmul_config(m, n, k, _num_sms(a.device))
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    groups = cdiv(k, GROUP)
    groups_per_split = cdiv(groups, cfg.split)
    split = cdiv(groups, groups_per_split)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    grid = (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n), split)
    _scaled_matmul_kernel[grid](a, a_scales, weight, w_scales, target, m, n, k, groups_per_split,
                                a.stride(0), weight.stride(0), n, m * n, a_scales.stride(0),
                                w_scales.stride(0) if block is not None else 0,
                                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP,
                                W_BLOCK_N=block[0] if block is not None else 0,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        sum_splits(target, out)
    return out


def sum_splits(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = parts.sum(0)`` for float32 partial products [splits, m, n] (contiguous), rounded once to
    ``out``'s dtype."""
    numel = out.numel()
    block = 1024
    _sum_splits_kernel[(cdiv(numel, block),)](parts, out, numel, parts.shape[0], numel, BLOCK=block,
                                                     num_warps=4)
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _scale_columns_kernel(x_ptr, s_ptr, num_rows, num_cols, stride_x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < num_cols)
    ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    scales = tl.load(s_ptr + cols, mask=cols < num_cols, other=0.0)
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x * scales[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


def scale_columns_(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x *= scales`` in place for x [m, n] (rows contiguous) and float32 scales [n], multiplied in float32 and
    rounded once. torch's broadcast multiply takes its unvectorized path here, which long prefill steps pay for
    (bench/RESULTS.md); this kernel reads and writes 16-byte vectors."""
    if x.dim() != 2 or x.stride(1) != 1 or scales.shape != (x.shape[1],) or scales.dtype != torch.float32:
        raise ValueError(f"scale_columns_: x {tuple(x.shape)} with contiguous rows and float32 scales of its "
                         f"{x.shape[-1]} columns expected, got scales {tuple(scales.shape)} {scales.dtype}")
    m, n = x.shape
    if m:
        block_m, block_n = 16, 256
        _scale_columns_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
            x, scales.contiguous(), m, n, x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return x
