"""Batched multi-LoRA products in Triton: one engine step's tokens, each under its own adapter or none, through the
LoRA branch of one linear layer in two launches, ``y += (x A_s^T) B_s^T``.

The adapters' weights are stacked in slots: ``a`` [S, R, K] and ``b`` [S, N, R], slot ``s`` holding one adapter's A
and B (R = slices x the largest rank, zero-padded; B already multiplied by the adapter's scaling). ``lora_shrink``
writes ``h = x A_s^T`` [T, R] in float32; ``lora_expand`` adds ``h B_s^T`` to the base layer's output ``y`` [T, N]
in place, as ``y = (y.float() + h B_s^T).to(y.dtype)``: float32 throughout, one rounding into ``y``.

Which token runs under which slot is given in one of two forms, each held on the device in buffers of a fixed size:

* Segmented (SGMV): ``token_order`` lists the tokens grouped by slot (slot 0's, then slot 1's, ...) and
  ``slot_starts`` [S + 1] bounds the groups: slot ``s`` owns ``token_order[slot_starts[s]:slot_starts[s + 1]]``.
  A program takes up to BLOCK_M tokens of one slot, gathers their rows and multiplies them with one tile of that
  slot's weights on the tensor cores, so the weights are read once per tile of tokens rather than once per token.
  This suits prefill steps and decode batches with several tokens per adapter.
* Per token (BGMV): ``token_slots`` [T] holds each token's slot, -1 for none. A program takes one token and one
  tile of its slot's weights and multiplies them on the CUDA cores (a matrix-vector product: no tile of 16 rows
  wasted on one token). This suits small decode steps, where most adapters have one or two tokens; the weights
  read again for each token come mostly from L2.

``segments`` (``engine.ops.lora_reference``, with the torch references) builds the segmented form from the
per-token one on the host. Tokens under no adapter appear in no segment (-1 in ``token_slots``): their rows of ``h``
are not written and their rows of ``y`` not touched. The buffers may be longer than the batch (T rows of x): only
the first ``slot_starts[S] <= T`` entries of ``token_order`` and the first T of ``token_slots`` are read.

CUDA graphs. Nothing here reads the mapping on the host: there is no ``.item()``, and every grid and compile-time
constant comes from shapes alone, so a step captured once replays with new mappings written into the same buffers.
A segmented program finds its work from ``slot_starts`` itself: it computes every slot's tile count,
``cdiv(n_s, BLOCK_M)``, and their prefix sum in registers (S + 1 loads), and takes the slot and tile its program id
falls in. The grid's first axis is the largest number of tiles any mapping of T tokens over S slots can need,
``(T - m) // BLOCK_M + m`` with ``m = min(S, T)`` (each non-empty slot wastes less than one tile), so at most
``m`` programs find no tile and return at once: the grid does not grow with ``S x T / BLOCK_M`` as a grid of one
axis per slot would. A per-token program reads its token's slot and returns at once for -1.

Shrink K split. The shrink has a large K (the hidden size, or the MLP's intermediate size) and a narrow output
(R), so at decode sizes it has few tiles: T=64 tokens of one adapter give one program streaming all of K. When the
grid's tiles of tokens times ``cdiv(R, BLOCK_N)`` would leave SMs idle, K is cut into ``split`` slices (each at
least four K steps) whose float32 partial products go to a workspace [split, T, R]; a second launch sums them in a
fixed order and writes the mapped rows of ``h``. Summing with float32 atomics into ``h`` would save that launch but
would need ``h``'s rows zeroed first, either all of them (writing rows this function leaves alone) or the mapped
ones by a launch of its own, and its sums would depend on the order the programs ran in. The workspace is
allocated per call (from the graph's pool under capture) and costs ``split x T x R x 4`` bytes, small next to x.
Bytes read: x is read once per R tile and each slot's A once per tile of tokens, hence BLOCK_M as large as the
expected tokens per slot allow (up to 64) and BLOCK_N covering R up to 64 columns in one tile. The expand has
N columns to spread over programs and is not split.

Tiles (``shrink_tiles``, ``expand_tiles``, from shapes only):

* BLOCK_M (segmented): the expected tokens per slot, ``T / min(S, T)``, as a power of two in 16..64.
* Shrink: BLOCK_N = R as a power of two in 16..64; BLOCK_K 128 when BLOCK_N <= 32, else 64. Per token:
  BLOCK_N 16..64 and ``BLOCK_N x BLOCK_K = 4096`` elements a step. Split as above, in powers of two.
* Expand: BLOCK_K (over R) 16 for R <= 16, else 32. Segmented BLOCK_N 128, 64 with BLOCK_M = 64 (the float32
  accumulator and B tile in registers); per token ``BLOCK_N x BLOCK_K = 4096``.

Numerics: float32 accumulation everywhere. The shrink multiplies x and A in the model dtype on the tensor cores.
The expand keeps ``h`` in float32 and loads B's tile as float32: TF32 on the tensor cores for 16-bit models (B
exact, h rounded to a 10-bit mantissa, as fine as float16's and finer than bfloat16's), exact float32 products for
float32 models. ``lora_shrink_reference`` and ``lora_expand_reference`` are the same products in torch, one matmul
per slot present, for any device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.intmath import cdiv, next_power_of_2
from engine.ops.lora_reference import lora_expand_reference, lora_shrink_reference, segments  # noqa: F401
from engine.ops.triton_helpers import jit_without_specializing


@dataclass(frozen=True)
class LoraTiles:
    """One launch's tiles: BLOCK_M tokens (segmented; 1 per token), BLOCK_N output columns (R for the shrink, N for
    the expand), BLOCK_K reduction columns a step (K, resp. R), K cut into ``split`` slices (shrink only)."""

    block_m: int
    block_n: int
    block_k: int
    split: int = 1
    num_warps: int = 4


def _clamp_pow2(value: int, lo: int, hi: int) -> int:
    return min(max(next_power_of_2(max(value, 1)), lo), hi)


def shrink_tiles(tokens: int, k: int, r: int, num_slots: int, num_sms: int, per_token: bool) -> LoraTiles:
    """Tiles of ``x [T, K] @ A_s^T`` (see the module's notes); K split while the expected programs leave SMs idle."""
    if per_token:
        block_m, block_n = 1, _clamp_pow2(r, 16, 64)
        block_k = 4096 // block_n
    else:
        block_m = _clamp_pow2(tokens // max(min(num_slots, tokens), 1), 16, 64)
        block_n = _clamp_pow2(r, 16, 64)
        block_k = 128 if block_n <= 32 else 64
    programs = (tokens if per_token else max_segment_tiles(tokens, num_slots, block_m)) * cdiv(r, block_n)
    split = 1
    while programs * split * 2 <= num_sms and cdiv(k, block_k) >= split * 2 * 4:
        split *= 2
    return LoraTiles(block_m, block_n, block_k, split)


def expand_tiles(tokens: int, n: int, r: int, num_slots: int, per_token: bool) -> LoraTiles:
    """Tiles of ``h [T, R] @ B_s^T`` (see the module's notes); R is the short reduction."""
    block_k = 16 if r <= 16 else 32
    if per_token:
        return LoraTiles(1, 4096 // block_k, block_k)
    block_m = _clamp_pow2(tokens // max(min(num_slots, tokens), 1), 16, 64)
    return LoraTiles(block_m, 64 if block_m == 64 else 128, block_k)


def max_segment_tiles(tokens: int, num_slots: int, block_m: int) -> int:
    """The most tiles of ``block_m`` tokens that ``tokens`` tokens grouped by slot over ``num_slots`` slots need."""
    m = min(num_slots, tokens)
    return (tokens - m) // block_m + m


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _segment_tile(slot_starts_ptr, num_slots, BLOCK_M: tl.constexpr, SLOTS: tl.constexpr):
    """This program's tile of the segmented mapping: (slot, first, end), positions ``first .. end - 1`` of
    ``token_order``, at most BLOCK_M of one slot; slot >= num_slots for a program past the last tile."""
    s = tl.arange(0, SLOTS)
    starts = tl.load(slot_starts_ptr + s, mask=s < num_slots, other=0)
    ends = tl.load(slot_starts_ptr + s + 1, mask=s < num_slots, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tiles_through = tl.cumsum(tiles, 0)  # tiles of slots 0 .. s
    tile = tl.program_id(0)
    slot = tl.sum((tiles_through <= tile).to(tl.int32), 0)
    here = s == slot
    first = tl.sum(tl.where(here, starts + (tile - tiles_through + tiles) * BLOCK_M, 0), 0)
    end = tl.sum(tl.where(here, ends, 0), 0)
    return slot, first, tl.minimum(end, first + BLOCK_M)


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, order_ptr, starts_ptr, out_ptr, num_slots, K, R, k_per_split,
                        stride_xt, stride_as, stride_ar, stride_ot, stride_os,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLOTS: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """``out[split, t, cols] = x[t, K slice] @ A[slot, cols, K slice]^T`` for one tile of a slot's tokens."""
    slot, first, end = _segment_tile(starts_ptr, num_slots, BLOCK_M, SLOTS)
    if slot >= num_slots:
        return
    pos = first + tl.arange(0, BLOCK_M)
    rows = pos < end
    tokens = tl.load(order_ptr + pos, mask=rows, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < R
    k_lo = tl.program_id(2) * k_per_split
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + (k_lo + offs_k)[None, :]
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + cols[None, :] * stride_ar + (k_lo + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, k_per_split // BLOCK_K):
        k_mask = offs_k < K - k_lo - i * BLOCK_K
        xt = tl.load(x_ptrs, mask=rows[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    out_ptrs = out_ptr + tl.program_id(2) * stride_os + tokens[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, acc, mask=rows[:, None] & col_mask[None, :])


@triton.jit
def _bgmv_shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, K, R, k_per_split,
                        stride_xt, stride_as, stride_ar, stride_ot, stride_os,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[split, t, cols] = A[slot(t), cols, K slice] @ x[t, K slice]`` for one token, on the CUDA cores."""
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < R
    offs_k = tl.program_id(2) * k_per_split + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xt + offs_k
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + cols[:, None] * stride_ar + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in range(0, k_per_split // BLOCK_K):
        k_mask = offs_k < K - i * BLOCK_K
        xv = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(a_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += av * xv[None, :]
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    out_ptrs = out_ptr + tl.program_id(2) * stride_os + token.to(tl.int64) * stride_ot + cols
    tl.store(out_ptrs, tl.sum(acc, 1), mask=col_mask)


@jit_without_specializing("num_tokens")
def _sum_splits_kernel(parts_ptr, map_ptr, starts_ptr, out_ptr, num_tokens, num_slots, R, stride_ps, stride_pt,
                       stride_ot, SPLIT: tl.constexpr, SEGMENTED: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """The mapped rows of ``out``: the sum of the K slices' partial products, slice 0 first."""
    pos = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if SEGMENTED:  # map = token_order: positions before slot_starts[S] hold mapped tokens
        rows = pos < tl.minimum(tl.load(starts_ptr + num_slots), num_tokens)
        tokens = tl.load(map_ptr + pos, mask=rows, other=0).to(tl.int64)
    else:  # map = token_slots
        rows = tl.load(map_ptr + pos, mask=pos < num_tokens, other=-1) >= 0
        tokens = pos.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows[:, None] & (cols < R)[None, :]
    offsets = tokens[:, None] * stride_pt + cols[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for part in range(0, SPLIT):
        acc += tl.load(parts_ptr + part * stride_ps + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + tokens[:, None] * stride_ot + cols[None, :], acc, mask=mask)


@triton.jit
def _sgmv_expand_kernel(h_ptr, b_ptr, order_ptr, starts_ptr, y_ptr, num_slots, N, R,
                        stride_ht, stride_bs, stride_bn, stride_yt,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLOTS: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """``y[t, cols] += h[t] @ B[slot, cols]^T`` for one tile of a slot's tokens, rounded into ``y`` once."""
    slot, first, end = _segment_tile(starts_ptr, num_slots, BLOCK_M, SLOTS)
    if slot >= num_slots:
        return
    pos = first + tl.arange(0, BLOCK_M)
    rows = pos < end
    tokens = tl.load(order_ptr + pos, mask=rows, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_r = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + tokens[:, None] * stride_ht + offs_r[None, :]
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn + offs_r[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, tl.cdiv(R, BLOCK_K)):
        r_mask = offs_r < R - i * BLOCK_K
        ht = tl.load(h_ptrs, mask=rows[:, None] & r_mask[None, :], other=0.0)
        bt = tl.load(b_ptrs, mask=r_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(ht, bt, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + cols[None, :]
    mask = rows[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bgmv_expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, N, R, stride_ht, stride_bs, stride_bn, stride_yt,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``y[t, cols] += B[slot(t), cols] @ h[t]`` for one token, on the CUDA cores, rounded into ``y`` once."""
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_r = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + token.to(tl.int64) * stride_ht + offs_r
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None].to(tl.int64) * stride_bn + offs_r[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in range(0, tl.cdiv(R, BLOCK_K)):
        r_mask = offs_r < R - i * BLOCK_K
        hv = tl.load(h_ptrs, mask=r_mask, other=0.0)
        bv = tl.load(b_ptrs, mask=col_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += bv * hv[None, :]
        h_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    y_ptrs = y_ptr + token.to(tl.int64) * stride_yt + cols
    y = tl.load(y_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + tl.sum(acc, 1)).to(y_ptr.dtype.element_ty), mask=col_mask)


def _check(op: str, inp: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, *mapping: torch.Tensor) -> None:
    """Shapes, dtypes and strides the kernels rely on: the shrink takes x in A's dtype to float32, the expand
    float32 h to y in B's dtype; last dimensions contiguous."""
    shrink = op.startswith("lora_shrink")
    if inp.dim() != 2 or weights.dim() != 3 or inp.shape[1] != weights.shape[2] or \
            out.shape != (inp.shape[0], weights.shape[1]):
        raise ValueError(f"{op}: shapes {tuple(inp.shape)} x {tuple(weights.shape)} -> {tuple(out.shape)} do not "
                         f"match ([T, in] x [S, out, in] -> [T, out])")
    model, low = (inp, out) if shrink else (out, inp)
    if model.dtype != weights.dtype or low.dtype != torch.float32:
        raise ValueError(f"{op}: dtypes {inp.dtype} x {weights.dtype} -> {out.dtype}; the LoRA rank's side must "
                         "be float32 and the other in the weights' dtype")
    if inp.stride(1) != 1 or out.stride(1) != 1 or weights.stride(2) != 1:
        raise ValueError(f"{op}: the last dimensions must be contiguous")
    if any(m.dtype != torch.int32 or m.device != inp.device for m in mapping):
        raise ValueError(f"{op}: the token mapping must be int32 on {inp.device}")


def _targets(out: torch.Tensor, split: int) -> tuple[torch.Tensor, int]:
    """Where the shrink's programs write: ``out`` itself, or a workspace of ``split`` partial products."""
    if split == 1:
        return out, 0
    parts = torch.empty((split, out.shape[0], out.shape[1]), dtype=torch.float32, device=out.device)
    return parts, parts.stride(0)


def _sum_splits(parts: torch.Tensor, mapping: torch.Tensor, slot_starts: torch.Tensor | None, num_slots: int,
                out: torch.Tensor) -> None:
    t, r = out.shape
    block_n = _clamp_pow2(r, 16, 128)
    grid = (cdiv(t, 32), cdiv(r, block_n))
    _sum_splits_kernel[grid](parts, mapping, mapping if slot_starts is None else slot_starts, out, t, num_slots, r,
                             parts.stride(0), parts.stride(1), out.stride(0), SPLIT=parts.shape[0],
                             SEGMENTED=slot_starts is not None, BLOCK_T=32, BLOCK_N=block_n)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_order: torch.Tensor, slot_starts: torch.Tensor,
                out: torch.Tensor) -> None:
    """Segmented: ``out[t] = x[t] @ a[s]^T`` (float32 [T, R]) for each slot ``s`` and token ``t`` of its segment
    of ``token_order``; rows of tokens in no segment are not written."""
    _check("lora_shrink", x, a, out, token_order, slot_starts)
    t, k = x.shape
    num_slots, r = a.shape[0], a.shape[1]
    if t == 0 or r == 0 or num_slots == 0:
        return
    tiles = shrink_tiles(t, k, r, num_slots, _num_sms(x.device), per_token=False)
    k_per_split = cdiv(cdiv(k, tiles.split), tiles.block_k) * tiles.block_k
    split = cdiv(k, k_per_split)
    target, stride_split = _targets(out, split)
    grid = (max_segment_tiles(t, num_slots, tiles.block_m), cdiv(r, tiles.block_n), split)
    _sgmv_shrink_kernel[grid](x, a, token_order, slot_starts, target, num_slots, k, r, k_per_split,
                              x.stride(0), a.stride(0), a.stride(1), target.stride(-2), stride_split,
                              BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                              SLOTS=max(2, next_power_of_2(num_slots)), DOT_PRECISION=_dot_precision(x.dtype),
                              num_warps=tiles.num_warps)
    if split > 1:
        _sum_splits(target, token_order, slot_starts, num_slots, out)


def lora_shrink_bgmv(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor) -> None:
    """Per token: ``out[t] = x[t] @ a[token_slots[t]]^T`` (float32 [T, R]); rows of tokens of slot -1 not written."""
    _check("lora_shrink_bgmv", x, a, out, token_slots)
    t, k = x.shape
    num_slots, r = a.shape[0], a.shape[1]
    if t == 0 or r == 0 or num_slots == 0:
        return
    tiles = shrink_tiles(t, k, r, num_slots, _num_sms(x.device), per_token=True)
    k_per_split = cdiv(cdiv(k, tiles.split), tiles.block_k) * tiles.block_k
    split = cdiv(k, k_per_split)
    target, stride_split = _targets(out, split)
    _bgmv_shrink_kernel[(t, cdiv(r, tiles.block_n), split)](
        x, a, token_slots, target, k, r, k_per_split, x.stride(0), a.stride(0), a.stride(1), target.stride(-2),
        stride_split, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps)
    if split > 1:
        _sum_splits(target, token_slots, None, num_slots, out)


def lora_expand(h: torch.Tensor, b: torch.Tensor, token_order: torch.Tensor, slot_starts: torch.Tensor,
                y: torch.Tensor) -> None:
    """Segmented: ``y[t] = (y[t].float() + h[t] @ b[s]^T).to(y.dtype)`` for each slot ``s`` and token ``t`` of
    its segment of ``token_order``; rows of tokens in no segment are not touched."""
    _check("lora_expand", h, b, y, token_order, slot_starts)
    t, r = h.shape
    num_slots, n = b.shape[0], b.shape[1]
    if t == 0 or r == 0 or num_slots == 0 or n == 0:
        return
    tiles = expand_tiles(t, n, r, num_slots, per_token=False)
    grid = (max_segment_tiles(t, num_slots, tiles.block_m), cdiv(n, tiles.block_n))
    _sgmv_expand_kernel[grid](h, b, token_order, slot_starts, y, num_slots, n, r,
                              h.stride(0), b.stride(0), b.stride(1), y.stride(0),
                              BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                              SLOTS=max(2, next_power_of_2(num_slots)), DOT_PRECISION=_dot_precision(y.dtype),
                              num_warps=tiles.num_warps)


def lora_expand_bgmv(h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor) -> None:
    """Per token: ``y[t] = (y[t].float() + h[t] @ b[token_slots[t]]^T).to(y.dtype)``; slot -1 rows not touched."""
    _check("lora_expand_bgmv", h, b, y, token_slots)
    t, r = h.shape
    num_slots, n = b.shape[0], b.shape[1]
    if t == 0 or r == 0 or num_slots == 0 or n == 0:
        return
    tiles = expand_tiles(t, n, r, num_slots, per_token=True)
    _bgmv_expand_kernel[(t, cdiv(n, tiles.block_n))](h, b, token_slots, y, n, r, h.stride(0), b.stride(0),
                                                     b.stride(1), y.stride(0), BLOCK_N=tiles.block_n,
                                                     BLOCK_K=tiles.block_k, num_warps=tiles.num_warps)
