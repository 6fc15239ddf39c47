"""The int4 product of decode steps of a few tokens on CUDA: a GEMV on the CUDA cores instead of the tensor cores.

``quant_matmul`` feeds the tensor cores, which want W's tile in registers in their own layout: each K step unpacks
the codes, dequantizes them to the compute dtype and shuffles them into place, and at one token that work, not the
bytes, sets its pace (~0.7 TB/s of codes on an H100, where cuBLAS reads bf16 at 2-2.9 TB/s). With one token
there is little to multiply, so this kernel skips the tensor cores: a program reads a [BLOCK_N, BLOCK_K / 8]
tile of 32-bit words (eight codes each, column 8w + j in bits 4j .. 4j + 3: the little-endian view of the packed
bytes) and for each of the eight nibble planes turns the codes into float32 with one OR and one subtraction
(``(q | 0x4B000000)`` read as a float is 2^23 + q), multiplies them with the tokens' activations for those columns
and adds. Scales and zeros are applied once per group, not per weight:

    sum_k W[n, k] x[k] = sum_groups  s * sum_k q[n, k] x[k]  +  (z - 8 s) * sum_k x[k]      (W = (q - 8) s + z)

so the float32 result is the exact dequantized product, not one of W rounded to bfloat16. K may be cut into
slices whose partial products are summed after, as in ``quant_matmul``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.intmath import cdiv, k_step, next_power_of_2

GEMV_MAX_ROWS = 1  # token counts the GEMV serves; more go to the tensor-core kernel. On an H100 (Llama-3.1-8B's
# projections, group 128; bench/RESULTS.md, 2026-12-07) it beat that kernel by 5-20% at one token and lost 2.5-3.2x
# at four: with more tokens the products, not the bytes, take the CUDA cores' time.


@triton.jit(do_not_specialize=["stride_am", "stride_cm", "stride_cs"])
def _int4_gemv_kernel(a_ptr, q_ptr, s_ptr, z_ptr, c_ptr, M, N, k_per_split, stride_am, stride_qn, stride_sn,
                      stride_cm, stride_cs, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_begin = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        words = tl.load(q_ptr + offs_n[:, None] * stride_qn + (k0 // 8 + offs_w)[None, :], mask=n_mask[:, None],
                        other=0)
        dots = tl.zeros([BLOCK_N, WORDS, BLOCK_M], tl.float32)
        xsum = tl.zeros([WORDS, BLOCK_M], tl.float32)
        for j in tl.static_range(8):
            q = ((words >> (4 * j)) & 15) | 0x4B000000
            qf = q.to(tl.float32, bitcast=True) - 8388608.0
            x = tl.load(a_ptr + offs_m[None, :] * stride_am + (k0 + offs_w * 8 + j)[:, None], mask=m_mask[None, :],
                        other=0.0).to(tl.float32)
            dots += qf[:, :, None] * x[None, :, :]
            xsum += x
        if GROUP >= BLOCK_K:
            g = k0 // GROUP
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
            shift = -8.0 * s
            if HAS_ZEROS:
                shift += tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
            acc += s[:, None] * tl.sum(dots, 1) + shift[:, None] * tl.sum(xsum, 0)[None, :]
        else:
            GS: tl.constexpr = BLOCK_K // GROUP
            at = offs_n[:, None] * stride_sn + (k0 // GROUP + tl.arange(0, GS))[None, :]
            s = tl.load(s_ptr + at, mask=n_mask[:, None], other=0.0).to(tl.float32)
            shift = -8.0 * s
            if HAS_ZEROS:
                shift += tl.load(z_ptr + at, mask=n_mask[:, None], other=0.0).to(tl.float32)
            per_group = tl.sum(tl.reshape(dots, [BLOCK_N, GS, WORDS // GS, BLOCK_M]), 2)
            x_group = tl.sum(tl.reshape(xsum, [GS, WORDS // GS, BLOCK_M]), 1)
            acc += tl.sum(per_group * s[:, :, None] + shift[:, :, None] * x_group[None, :, :], 1)
    out_ptrs = c_ptr + pid_k * stride_cs + offs_m[None, :] * stride_cm + offs_n[:, None]
    tl.store(out_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@dataclass(frozen=True)
class GemvTiles:
    """``block_n`` weight rows a program, K steps of ``block_k`` columns, K cut into ``split`` slices."""

    block_n: int
    block_k: int
    split: int
    num_warps: int


def gemv_block_k(k: int, group: int, widest: int = 512) -> int | None:
    """The GEMV's K step: at most ``widest`` columns and at least 64 (eight 32-bit words) (``k_step``)."""
    return k_step(k, group, widest, 64)


def choose_gemv_tiles(m: int, n: int, k: int, group: int, num_sms: int) -> GemvTiles | None:
    """Tiles for the GEMV of ``m`` (<= ``GEMV_MAX_ROWS``) tokens, or None where it does not take the shape: K not
    cut into steps of 64 columns that fit the groups. From a sweep on an H100 over Llama-3.1-8B's projections
    (``bench/quant_gemm.py --sweep --gemv``): weight tiles of 32 rows, K steps of 512 columns, 4 warps, K cut until
    ~3 programs per SM stream their share (qkv in two, o and down in four, gate|up whole)."""
    if m > GEMV_MAX_ROWS:
        return None
    block_k = gemv_block_k(k, group)
    if block_k is None:
        return None
    block_n = 32
    tiles, steps, split = cdiv(n, block_n), k // block_k, 1
    while tiles * split < 2.9 * num_sms and steps % (split * 2) == 0 and steps // (split * 2) >= 2:
        split *= 2
    return GemvTiles(block_n, block_k, split, 4)


def _launch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
            tiles: GemvTiles, out: torch.Tensor) -> None:
    m, k = x.shape
    n = codes.shape[0]
    if k % (tiles.block_k * tiles.split) or (tiles.block_k % group and group % tiles.block_k):
        raise ValueError(f"int4_gemv: {tiles} does not cut K={k} with groups of {group}")
    if codes.stride(1) != 1 or codes.stride(0) % 4 or x.stride(1) != 1:
        raise ValueError("int4_gemv: the codes' and activations' rows must be contiguous, codes rows 4-byte aligned")
    words = codes.view(torch.int32)
    grid = (cdiv(n, tiles.block_n), tiles.split)
    _int4_gemv_kernel[grid](
        x, words, scales, zeros if zeros is not None else scales, out, m, n, k // tiles.split, x.stride(0),
        words.stride(0), scales.stride(0), out.stride(-2), out.stride(0) if out.dim() == 3 else 0, GROUP=group,
        HAS_ZEROS=zeros is not None, BLOCK_M=max(1, next_power_of_2(m)), BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps)


def int4_gemv_parts(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group: int, tiles: GemvTiles, dtype: torch.dtype) -> torch.Tensor:
    """``x W^T`` for W's int4 ``codes`` [N, K / 2] (two a byte, column 2j in the low nibble) with ``scales`` and
    ``zeros`` [N, K / group]: the products of ``tiles.split`` slices of K, [split, M, N] in ``dtype``."""
    parts = torch.empty((tiles.split, x.shape[0], codes.shape[0]), dtype=dtype, device=x.device)
    if x.shape[0]:
        _launch(x, codes, scales, zeros, group, tiles, parts)
    return parts
