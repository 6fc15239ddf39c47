"""Triton kernels of the int4 and int8 linear layers on CUDA (``engine.models.linear.int4`` and ``int8``): products
that read the weight's codes, so a decode step streams 4 or 8 bits a weight instead of 16.

The weights (``QuantWeight``; W [N, K], a scale and optionally a zero per row and group of ``group`` columns):

    int4   codes [N, K / 2] uint8 in chunks of ``step`` columns, byte j of a chunk holding its column j (low nibble)
           and j + step / 2 (high), repacked once from the method's layout (``int4_weight``); W = (q - 8) s + z
    int8   codes [N, K] int8 as the method holds them; W = q s (+ z)

* ``quant_matmul``: ``x W^T`` for x [M, K] in the compute dtype. A program computes one [BLOCK_N, BLOCK_M] tile of
  C^T = W @ A^T over a slice of K (the weight rows on the tensor cores' wide side, the few tokens of a decode step
  on the narrow one, as the FP8 kernel does). int4: each K step multiplies the two halves of a chunk's codes, made
  exact 16-bit floats by an offset (bfloat16 128 + q: the bits 0x4300 | q, one OR a value), with the activations
  on the tensor cores, and applies the half's group scale and zero to the float32 product; so a weight costs an
  AND or a shift and an OR on its way in, not a dequantization. int8: each K step dequantizes its tile in float32
  and rounds it to the compute dtype. At decode sizes K is cut into as many slices as it takes to give every SM
  programs to run; the slices' partial products are either summed by a second launch (``quant_matmul``) or handed
  to the kernel that reads the product (``quant_matmul_partials``, as the 16-bit layers' K-split hands them).
* ``dequantize``: W in the compute dtype (each element computed in float32 and rounded once, as the methods' torch
  code does), for prefill-sized products, which multiply it on cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.fp8 import sum_splits
from engine.ops.intmath import cdiv, next_power_of_2


@triton.jit
def _int8_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, stride_qn, stride_sn, out_dtype, GROUP: tl.constexpr,
               HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``offs_n``, columns k0 .. k0 + BLOCK_K of an int8 W ([BLOCK_N, BLOCK_K] in ``out_dtype``): q s (+ z) in
    float32, rounded once; k0 a multiple of BLOCK_K, and BLOCK_K a multiple of GROUP or a divisor of it."""
    cols = k0 + tl.arange(0, BLOCK_K)
    codes = tl.load(q_ptr + offs_n[:, None] * stride_qn + cols[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
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


@triton.jit
def _int4_half_product(codes, a, s_ptr, z_ptr, offs_n, n_mask, group, stride_sn, acc, HAS_ZEROS: tl.constexpr):
    """``acc`` plus one half chunk's product: ``codes`` [BLOCK_N, HALF] (0-15, uint8) times ``a`` [HALF, BLOCK_M]
    (A^T's rows), every column of the half in group ``group``. The codes go to the tensor cores as they are, with
    an offset that makes them exact 16-bit floats, and the scales and zeros are applied to the product:
    sum_k ((q - 8) s + z) a_k = s (sum_k (q + c) a_k - (c + 8) sum_k a_k) + z sum_k a_k."""
    if a.dtype == tl.bfloat16:  # 0x4300 | q is the bfloat16 128 + q
        values = ((codes & 15).to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        product = tl.dot(values, a) - 136.0 * tl.sum(a.to(tl.float32), 0)[None, :]
    elif a.dtype == tl.float16:  # 0x6400 | q is the float16 1024 + q
        values = ((codes & 15).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        product = tl.dot(values, a) - 1032.0 * tl.sum(a.to(tl.float32), 0)[None, :]
    else:  # float32: IEEE products, not TF32
        product = tl.dot((codes & 15).to(tl.float32) - 8.0, a, input_precision="ieee")
    scales = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
    acc += scales[:, None] * product
    if HAS_ZEROS:
        zeros = tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
        acc += zeros[:, None] * tl.sum(a.to(tl.float32), 0)[None, :]
    return acc


# The token count and what follows from it change every step: not specialized, so no step compiles a variant.
@triton.jit(do_not_specialize=["M", "stride_am", "stride_cm", "stride_cs"])
def _quant_matmul_kernel(a_ptr, q_ptr, s_ptr, z_ptr, c_ptr, M, N, k_per_split, stride_am, stride_qn, stride_sn,
                         stride_cm, stride_cs, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_M] tile of C^T = W @ A^T over one slice of K. int4: a K step is one chunk of the CUDA
    layout (BLOCK_K columns, its byte j holding column j and j + BLOCK_K / 2), each half within one group."""
    pid_m = tl.program_id(0)  # fastest: the programs that read one weight tile run together
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_begin = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        if BITS == 4:
            half = tl.arange(0, BLOCK_K // 2)
            packed = tl.load(q_ptr + offs_n[:, None] * stride_qn + (k0 // 2 + half)[None, :], mask=n_mask[:, None],
                             other=0)
            a_ptrs = a_ptr + offs_m[None, :] * stride_am + (k0 + half)[:, None]
            a_lo = tl.load(a_ptrs, mask=m_mask[None, :], other=0.0)
            a_hi = tl.load(a_ptrs + BLOCK_K // 2, mask=m_mask[None, :], other=0.0)
            acc = _int4_half_product(packed, a_lo, s_ptr, z_ptr, offs_n, n_mask, k0 // GROUP, stride_sn, acc,
                                     HAS_ZEROS)
            acc = _int4_half_product(packed >> 4, a_hi, s_ptr, z_ptr, offs_n, n_mask, (k0 + BLOCK_K // 2) // GROUP,
                                     stride_sn, acc, HAS_ZEROS)
        else:
            w = _int8_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, stride_qn, stride_sn, a_ptr.dtype.element_ty,
                           GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
            a = tl.load(a_ptr + offs_m[None, :] * stride_am + (k0 + tl.arange(0, BLOCK_K))[:, None],
                        mask=m_mask[None, :], other=0.0)
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
    if BITS == 4:
        half = tl.arange(0, BLOCK_K // 2)
        packed = tl.load(q_ptr + offs_n[:, None] * stride_qn + (k0 // 2 + half)[None, :], mask=n_mask[:, None],
                         other=0)
        for which in tl.static_range(2):
            group = (k0 + which * (BLOCK_K // 2)) // GROUP
            scales = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
            w = (((packed >> (4 * which)) & 15).to(tl.float32) - 8.0) * scales[:, None]
            if HAS_ZEROS:
                w += tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            cols = k0 + which * (BLOCK_K // 2) + half
            tl.store(w_ptr + offs_n[:, None] * stride_wn + cols[None, :], w.to(w_ptr.dtype.element_ty),
                     mask=n_mask[:, None])
    else:
        w = _int8_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, stride_qn, stride_sn, w_ptr.dtype.element_ty,
                       GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        tl.store(w_ptr + offs_n[:, None] * stride_wn + cols[None, :], w, mask=n_mask[:, None])


@dataclass(frozen=True)
class QuantWeight:
    """A layer's quantized W as the kernels read it: ``codes``, ``scales`` and ``zeros`` (None: none) [N, K / group]
    in the compute dtype, ``bits`` 4 or 8, ``group`` the columns a scale covers (K for one a row), ``step`` the
    columns of a K step. int8 codes are [N, K] int8 as the method holds them; int4 codes [N, K / 2] uint8 in the
    CUDA layout (``int4_weight``): chunks of ``step`` columns, byte j of a chunk holding its column j (low nibble)
    and j + step / 2 (high), so that a K step is two products of plain halves, each within one group."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group: int
    step: int

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return n, k * 2 if self.bits == 4 else k


def int4_step(k: int, group: int) -> int | None:
    """The K step of an int4 W: the widest chunk of at most 128 columns, at least 32, that divides K and whose halves
    each lie within one group; None if there is none."""
    step = min(128, 2 * group)
    while step >= 32:
        if k % step == 0 and group % (step // 2) == 0:
            return step
        step //= 2
    return None


def int4_weight(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group: int) -> QuantWeight | None:
    """The kernels' int4 weight from the method's codes (``pack_int4``'s layout, [N, K / 2]): repacked into chunks
    (``QuantWeight``); None where K has no step (``int4_step``)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    step = int4_step(k, group)
    if step is None:
        return None
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).view(n, k // step, 2, step // 2)
    chunked = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k // 2)
    return QuantWeight(chunked.contiguous(), scales, zeros, 4, group, step)


def int8_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group: int) -> QuantWeight | None:
    """The kernels' int8 weight (the method's tensors as they are); None where K has no step of 32 columns or more
    that fits the groups."""
    step = block_k_for(codes.shape[1], group)
    return None if step is None else QuantWeight(codes, scales, zeros, 8, group, step)


@dataclass(frozen=True)
class Tiles:
    """``block_m`` tokens x ``block_n`` weight rows a program, K cut into ``split`` slices (the K step is the
    weight's)."""

    block_m: int
    block_n: int
    split: int
    num_warps: int
    num_stages: int


def block_k_for(k: int, group: int, widest: int = 128) -> int | None:
    """The widest K step of at most ``widest`` columns (and at least 32) that divides ``k`` and fits the groups
    (a multiple of the group or a divisor of it); None if there is none."""
    block = widest
    while block >= 32:
        if k % block == 0 and (block % group == 0 or group % block == 0):
            return block
        block //= 2
    return None


def choose_tiles(m: int, n: int, k: int, step: int, num_sms: int) -> Tiles:
    """Tiles for an [m, k] x [k, n] product whose K steps are ``step`` columns. Decode sizes read the weight: a
    narrow token tile, weight tiles of 64 rows and K cut until about two programs per SM stream their share."""
    block_m = min(64, max(16, next_power_of_2(m)))
    block_n = 64 if m <= 32 else 128
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    steps = k // step
    split = 1
    while tiles * split < 2 * num_sms and steps % (split * 2) == 0 and steps // (split * 2) >= 4:
        split *= 2
    return Tiles(block_m, block_n, split, 4 if block_n == 64 else 8, 4 if block_m <= 32 else 3)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _check(x: torch.Tensor, weight: QuantWeight, tiles: Tiles) -> tuple[int, int, int]:
    m, k = x.shape
    n, wk = weight.shape
    if wk != k or x.stride(1) != 1 or weight.codes.stride(1) != 1:
        raise ValueError(f"quant_matmul: x {tuple(x.shape)} (rows contiguous) does not match W {(n, wk)}")
    if k % (weight.step * tiles.split):
        raise ValueError(f"quant_matmul: {tiles} does not cut K={k} into steps of {weight.step}")
    return m, n, k


def _launch(x: torch.Tensor, weight: QuantWeight, tiles: Tiles, out: torch.Tensor) -> None:
    m, n, k = x.shape[0], *weight.shape
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    grid = (cdiv(m, tiles.block_m), cdiv(n, tiles.block_n), tiles.split)
    _quant_matmul_kernel[grid](
        x, weight.codes, weight.scales, zeros, out, m, n, k // tiles.split, x.stride(0), weight.codes.stride(0),
        weight.scales.stride(0), out.stride(-2), out.stride(0) if out.dim() == 3 else 0,
        BITS=weight.bits, GROUP=weight.group, HAS_ZEROS=weight.zeros is not None, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=weight.step, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def quant_matmul(x: torch.Tensor, weight: QuantWeight, tiles: Tiles | None = None) -> torch.Tensor:
    """``x W^T``: x [M, K] (the compute dtype) -> [M, N] in x's dtype, accumulated in float32; K's slices (if any)
    summed in float32 and rounded once."""
    tiles = tiles or choose_tiles(x.shape[0], weight.shape[0], x.shape[1], weight.step, _num_sms(x.device))
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


def quant_matmul_partials(x: torch.Tensor, weight: QuantWeight, tiles: Tiles) -> torch.Tensor:
    """``x W^T`` as the products of ``tiles.split`` slices of K, [split, M, N] in x's dtype: a reader adds them (in
    float32, rounding once; ``LinearOutput.partials``)."""
    m, n, _ = _check(x, weight, tiles)
    parts = torch.empty((tiles.split, m, n), dtype=x.dtype, device=x.device)
    if m:
        _launch(x, weight, tiles, parts)
    return parts


def dequantize(weight: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in ``dtype``: each element (q - offset) s (+ z) computed in float32 and rounded once."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.codes.device)
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    block_n = 64
    _dequantize_kernel[(cdiv(n, block_n), k // weight.step)](
        weight.codes, weight.scales, zeros, out, n, weight.codes.stride(0), weight.scales.stride(0), out.stride(0),
        BITS=weight.bits, GROUP=weight.group, HAS_ZEROS=weight.zeros is not None, BLOCK_N=block_n,
        BLOCK_K=weight.step, num_warps=4)
    return out
