"""Triton kernels of the int4 and int8 linear layers on CUDA (``engine.models.linear.int4`` and ``int8``): products
that read the weight's codes, so a decode step streams 4 or 8 bits a weight instead of 16.

The weights, as the methods hold them (W [N, K], a scale and optionally a zero per row and group of ``group``
columns):

    int4   codes [N, K / 2] uint8, two a byte (column 2j in the low nibble, 2j + 1 in the high); W = (q - 8) s + z
    int8   codes [N, K] int8; W = q s (+ z)

* ``quant_matmul``: ``x W^T`` for x [M, K] in the compute dtype. A program computes one [BLOCK_N, BLOCK_M] tile of
  C^T = W @ A^T over a slice of K (the weight rows on the tensor cores' wide side, the few tokens of a decode step
  on the narrow one, as the FP8 kernel does): each K step loads a tile of codes, unpacks it, dequantizes it in
  float32 with its groups' scales (and zeros), rounds it to the compute dtype (the rounding of ``dequantize_int4``)
  and multiplies it with the activations on the tensor cores. At decode sizes K is cut into as many slices as it
  takes to give every SM programs to run; the slices' partial products are either summed by a second launch
  (``quant_matmul``) or handed to the kernel that reads the product (``quant_matmul_partials``, as the 16-bit
  layers' K-split hands them).
* ``dequantize``: W in the compute dtype, for prefill-sized products, where a dense product on cuBLAS beats
  dequantizing inside every tile (the tiles are read once per BLOCK_M tokens; the dequantized copy once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.fp8 import sum_splits
from engine.ops.intmath import cdiv, k_step, next_power_of_2
from engine.ops.quant_gemv import GemvTiles, choose_gemv_tiles, int4_gemv_parts


@triton.jit
def _dequantized_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, stride_qn, stride_sn, out_dtype,
                      BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``offs_n``, columns k0 .. k0 + BLOCK_K of W ([BLOCK_N, BLOCK_K] in ``out_dtype``); k0 a multiple of
    BLOCK_K, and BLOCK_K a multiple of GROUP or a divisor of it."""
    if BITS == 4:
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(q_ptr + offs_n[:, None] * stride_qn + cols[None, :], mask=n_mask[:, None], other=0)
        codes = tl.interleave(packed & 15, packed >> 4).to(tl.float32) - 8.0
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(q_ptr + offs_n[:, None] * stride_qn + cols[None, :], mask=n_mask[:, None],
                        other=0).to(tl.float32)
    if GROUP >= BLOCK_K:
        group = k0 // GROUP
        scales = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
        w = codes * scales[:, None]
        if HAS_ZEROS:
            w += tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    else:
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        at = offs_n[:, None] * stride_sn + groups[None, :]
        scales = tl.load(s_ptr + at, mask=n_mask[:, None], other=0.0).to(tl.float32)
        w = tl.reshape(codes, [BLOCK_N, BLOCK_K // GROUP, GROUP]) * scales[:, :, None]
        if HAS_ZEROS:
            w += tl.load(z_ptr + at, mask=n_mask[:, None], other=0.0).to(tl.float32)[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    return w.to(out_dtype)


# The token count and what follows from it change every step: not specialized, so no step compiles a variant.
@triton.jit(do_not_specialize=["M", "stride_am", "stride_cm", "stride_cs"])
def _quant_matmul_kernel(a_ptr, q_ptr, s_ptr, z_ptr, c_ptr, M, N, k_per_split, stride_am, stride_qn, stride_sn,
                         stride_cm, stride_cs, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the programs that read one weight tile run together
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_begin = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        w = _dequantized_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, stride_qn, stride_sn, a_ptr.dtype.element_ty,
                              BITS, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
        a = tl.load(a_ptr + offs_m[None, :] * stride_am + (k0 + offs_k)[:, None], mask=m_mask[None, :], other=0.0)
        if a_ptr.dtype.element_ty == tl.float32:  # a float32 model multiplies in float32, not TF32
            acc = tl.dot(w, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a, acc)
    out_ptrs = c_ptr + pid_k * stride_cs + offs_m[None, :] * stride_cm + offs_n[:, None]
    tl.store(out_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, stride_qn, stride_sn, stride_wn, BITS: tl.constexpr,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = offs_n < N
    w = _dequantized_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, stride_qn, stride_sn, w_ptr.dtype.element_ty,
                          BITS, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + cols[None, :], w, mask=n_mask[:, None])


@dataclass(frozen=True)
class QuantWeight:
    """A layer's quantized W as the kernels read it: ``codes`` (int4: [N, K / 2] uint8; int8: [N, K] int8),
    ``scales`` and ``zeros`` (None: none) [N, K / group] in the compute dtype, ``bits`` 4 or 8, ``group`` the columns
    a scale covers (K for one a row)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return n, k * 2 if self.bits == 4 else k


@dataclass(frozen=True)
class Tiles:
    """``block_m`` tokens x ``block_n`` weight rows a program, K steps of ``block_k`` columns, K cut into ``split``
    slices."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int
    num_stages: int


def block_k_for(k: int, group: int, widest: int = 128) -> int | None:
    """The tensor-core kernel's K step: at most ``widest`` columns and at least 32 (``k_step``)."""
    return k_step(k, group, widest, 32)


def choose_tiles(m: int, n: int, k: int, group: int, num_sms: int) -> Tiles | None:
    """Tiles for an [m, k] x [k, n] product; None where the kernel does not take the shape (K not cut into steps
    of 32 columns that fit the groups). From a sweep on an H100 over Llama-3.1-8B's projections (bench/RESULTS.md,
    2026-12-07; ``bench/quant_gemm.py --sweep``): up to 16 tokens, weight tiles of 64 rows, 4 warps, and K cut in
    two at least and until ~1.8 programs per SM stream their share (gate|up's 448 tiles too: 30% faster cut in two);
    more tokens, tiles of 128 rows on 8 warps, K cut until the programs about fill the SMs."""
    block_k = block_k_for(k, group)
    if block_k is None:
        return None
    block_m = min(64, max(16, next_power_of_2(m)))
    few = m <= 16
    block_n = 64 if few else 128
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    steps = k // block_k
    split, fill = 1, (1.8 if few else 0.9) * num_sms

    def can_cut() -> bool:
        return steps % (split * 2) == 0 and steps // (split * 2) >= 4

    while (tiles * split < fill or (few and split == 1)) and can_cut():
        split *= 2
    return Tiles(block_m, block_n, block_k, split, 4 if few else 8, 3)


def choose_product_tiles(m: int, n: int, k: int, group: int, bits: int, num_sms: int) -> Tiles | GemvTiles | None:
    """The kernel and tiles for a product of ``m`` tokens: the int4 GEMV (``engine.ops.quant_gemv``) for a few
    tokens where it takes the shape, else the tensor-core kernel's ``choose_tiles``."""
    gemv = choose_gemv_tiles(m, n, k, group, num_sms) if bits == 4 else None
    return gemv or choose_tiles(m, n, k, group, num_sms)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _check(x: torch.Tensor, weight: QuantWeight, tiles: Tiles) -> tuple[int, int, int]:
    m, k = x.shape
    n, wk = weight.shape
    if wk != k or x.stride(1) != 1 or weight.codes.stride(1) != 1:
        raise ValueError(f"quant_matmul: x {tuple(x.shape)} (rows contiguous) does not match W {(n, wk)}")
    if k % (tiles.block_k * tiles.split) or (tiles.block_k % weight.group and weight.group % tiles.block_k):
        raise ValueError(f"quant_matmul: {tiles} does not cut K={k} with groups of {weight.group}")
    return m, n, k


def _launch(x: torch.Tensor, weight: QuantWeight, tiles: Tiles, out: torch.Tensor) -> None:
    m, n, k = x.shape[0], *weight.shape
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    grid = (cdiv(m, tiles.block_m), cdiv(n, tiles.block_n), tiles.split)
    _quant_matmul_kernel[grid](
        x, weight.codes, weight.scales, zeros, out, m, n, k // tiles.split, x.stride(0), weight.codes.stride(0),
        weight.scales.stride(0), out.stride(-2), out.stride(0) if out.dim() == 3 else 0,
        BITS=weight.bits, GROUP=weight.group, HAS_ZEROS=weight.zeros is not None, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _gemv_parts(x: torch.Tensor, weight: QuantWeight, tiles: GemvTiles, dtype: torch.dtype) -> torch.Tensor:
    if weight.bits != 4:
        raise ValueError(f"quant_matmul: the GEMV takes int4 W, not {weight.bits}-bit")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"quant_matmul: x {tuple(x.shape)} does not match W {weight.shape}")
    return int4_gemv_parts(x, weight.codes, weight.scales, weight.zeros, weight.group, tiles, dtype)


def quant_matmul(x: torch.Tensor, weight: QuantWeight, tiles: Tiles | GemvTiles | None = None) -> torch.Tensor:
    """``x W^T``: x [M, K] (the compute dtype) -> [M, N] in x's dtype, accumulated in float32; K's slices (if any)
    summed in float32 and rounded once. ``tiles`` (default: ``choose_product_tiles``) picks the kernel."""
    tiles = tiles or choose_product_tiles(x.shape[0], weight.shape[0], x.shape[1], weight.group, weight.bits,
                                          _num_sms(x.device))
    if isinstance(tiles, GemvTiles):
        if tiles.split == 1:
            return _gemv_parts(x, weight, tiles, x.dtype)[0]
        return sum_splits(_gemv_parts(x, weight, tiles, torch.float32), torch.empty(
            (x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device))
    m, n, _ = _check(x, weight, tiles)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if tiles.split == 1:
        _launch(x, weight, tiles, out)
        return out
    parts = torch.empty((tiles.split, m, n), dtype=torch.float32, device=x.device)
    _launch(x, weight, tiles, parts)
    return sum_splits(parts, out)


def quant_matmul_partials(x: torch.Tensor, weight: QuantWeight, tiles: Tiles | GemvTiles) -> torch.Tensor:
    """``x W^T`` as the products of ``tiles.split`` slices of K, [split, M, N] in x's dtype: a reader adds them (in
    float32, rounding once; ``LinearOutput.partials``)."""
    if isinstance(tiles, GemvTiles):
        return _gemv_parts(x, weight, tiles, x.dtype)
    m, n, _ = _check(x, weight, tiles)
    parts = torch.empty((tiles.split, m, n), dtype=x.dtype, device=x.device)
    if m:
        _launch(x, weight, tiles, parts)
    return parts


def dequantize(weight: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in ``dtype``: each element (q - offset) s (+ z) computed in float32 and rounded once."""
    n, k = weight.shape
    block_k = block_k_for(k, weight.group)
    if block_k is None:
        raise ValueError(f"dequantize: K={k} is not cut into steps of 32 columns that fit groups of {weight.group}")
    out = torch.empty((n, k), dtype=dtype, device=weight.codes.device)
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    block_n = 64
    _dequantize_kernel[(cdiv(n, block_n), k // block_k)](
        weight.codes, weight.scales, zeros, out, n, weight.codes.stride(0), weight.scales.stride(0), out.stride(0),
        BITS=weight.bits, GROUP=weight.group, HAS_ZEROS=weight.zeros is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4)
    return out
