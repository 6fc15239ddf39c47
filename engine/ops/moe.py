"""Fused mixture-of-experts in Triton: the experts of ``engine.models.moe`` with no host syncs.

The torch reference loops over the experts on the host; here a layer's experts are a fixed sequence of
launches whose grids and compile-time constants depend only on shapes, so a decode step can be captured in a
CUDA graph and replayed with new routing.

Routing layout (``align_routing``). The ``T * k`` (token, slot) choices are numbered
``pair = token * k + slot`` (``top_ids.reshape(-1)``'s order). They are sorted by expert (stably: by pair within
an expert) and each expert's segment is padded to a whole number of ``BLOCK_M`` rows, so that every block of
``BLOCK_M`` sorted rows belongs to one expert. With ``k = 2``, ``E = 4``, ``BLOCK_M = 4`` and 5 tokens::

    top_ids          [[0, 2], [2, 3], [0, 2], [2, 0], [2, 3]]    pairs 0..9
    sorted_pairs     | 0 4 7 - | 1 2 5 6 | 8 - - - | 3 9 - - | - - - - ...    expert 1 gets no rows
    block_experts      0         2         2         3         -1 ...

``-`` is the padding value ``T * k`` (no pair); blocks past the last expert's segment have expert ``-1`` and their
programs return at once. The padded length is at most ``T * k + min(E, T * k) * (BLOCK_M - 1)`` (each expert
that gets a row wastes fewer than ``BLOCK_M``), rounded up to a block: a static bound, so the arrays' sizes and
the grids never depend on the routing. Two launches of one program per expert build it on the device: each
counts its expert's pairs, then each places its pairs (a running cumsum over the routing gives their order), its
padding rows and its blocks' ids, its segment starting after the padded counts of the experts before it.

The experts' MLP is then two launches of one grouped GEMM kernel, ``C[pair] = A[row(pair)] @ W[expert]^T``, and
a sum; rows are addressed by pair, so nothing is scattered or gathered between them:

* gate/up: ``A = x`` [T, H] read at row ``pair // k``, ``W = w13`` [E, 2I, H]; each program holds the gate tile
  (columns ``n``) and the up tile (columns ``I + n``) and writes ``silu(gate) * up`` to ``act`` [T * k, I].
* down: ``A = act`` read at row ``pair``, ``W = w2`` [E, H, I]; the epilogue multiplies each row by its
  routing weight and writes ``out`` [T * k, H].
* ``out.view(T, k, H).sum(1)``: every token's ``k`` rows in slot order, accumulated in float32 by torch.

Grid ``(blocks, cdiv(N, BLOCK_N))``: program ``(b, j)`` owns the ``BLOCK_M`` sorted rows of block ``b`` (one
expert) and output columns ``j * BLOCK_N ...``; it walks K in ``BLOCK_K`` steps, loading the gathered rows of A
and the expert's weight tile, and accumulates in float32. Each output element is written by exactly one program
and the slot sum has a fixed order, so results are deterministic. Padding rows load zeros and store nothing.
Block sizes (``choose_blocks``) follow the expected rows per expert, ``T * k / E``: a decode step of up to a few
hundred tokens on 128 experts gives most experts 0-16 rows, hence ``BLOCK_M = 16`` there.

A layer's time on Qwen3-30B-A3B's experts under CUDA graphs, against the time its experts' weights take to read:
bench/RESULTS.md.

Numerics: float32 accumulation, one rounding to the activation dtype for ``act`` and one for each pair's output
row (the reference rounds after each linear and after the product). float32 inputs use exact float32 dots
(no TF32), so float32 results match the reference to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.intmath import cdiv, next_power_of_2

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    """Program ``e``: how many of the ``num_pairs`` routing choices picked expert ``e``."""
    expert = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
        count += (ids == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(count, axis=0))


@triton.jit(do_not_specialize=["num_pairs"])
def _align_kernel(ids_ptr, counts_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_experts, num_rows,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``e`` writes expert ``e``'s segment of the layout: its pairs in pair order, its padding rows and
    its blocks' expert id; the last program also fills the rows and blocks past the last segment.

    The segment starts at the sum of the padded counts of the experts before ``e``; a pair's row in it is the
    number of earlier pairs of expert ``e`` (a running cumsum over the routing, ``BLOCK`` pairs at a time)."""
    expert = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    mine = offs_e == expert
    seg_start = tl.sum(tl.where(mine, ends - padded, 0), axis=0)
    count = tl.sum(tl.where(mine, counts, 0), axis=0)

    offs = tl.arange(0, BLOCK)
    seen = 0
    for start in range(0, num_pairs, BLOCK):
        pairs = start + offs
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        rows = seg_start + seen + tl.cumsum(hit, axis=0) - hit
        tl.store(sorted_pairs_ptr + rows, pairs, mask=hit != 0)
        seen += tl.sum(hit, axis=0)

    offs_m = tl.arange(0, BLOCK_M)
    tail = seg_start + count + offs_m  # fewer than BLOCK_M padding rows end the segment
    seg_end = seg_start + tl.cdiv(count, BLOCK_M) * BLOCK_M
    tl.store(sorted_pairs_ptr + tail, tl.zeros_like(offs_m) + num_pairs, mask=tail < seg_end)
    for b in range(seg_start // BLOCK_M, seg_end // BLOCK_M, BLOCK):
        tl.store(block_experts_ptr + b + offs, tl.zeros_like(offs) + expert, mask=b + offs < seg_end // BLOCK_M)

    if expert == num_experts - 1:  # past the last segment: padding rows, blocks marked -1
        total = tl.sum(padded, axis=0)
        for r in range(total, num_rows, BLOCK):
            tl.store(sorted_pairs_ptr + r + offs, tl.zeros_like(offs) + num_pairs, mask=r + offs < num_rows)
        for b in range(total // BLOCK_M, num_rows // BLOCK_M, BLOCK):
            tl.store(block_experts_ptr + b + offs, tl.full([BLOCK], -1, tl.int32), mask=b + offs < num_rows // BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, routing_ptr,
    num_pairs, N, K, stride_am, stride_we, stride_wn, stride_om,
    A_ROW_DIV: tl.constexpr, GATE_UP: tl.constexpr, ROUTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One block of sorted rows (one expert) times one ``BLOCK_N`` column tile of that expert's weight.

    Row ``pair`` of the output is ``A[pair // A_ROW_DIV] @ W[expert, cols]^T``; with ``GATE_UP`` the weight's
    rows ``N + cols`` are the up projection and the output is ``silu(gate) * up``; with ``ROUTED`` it is scaled by
    ``routing[pair]``. W is contiguous in K (``[E, rows, K]``), A and the output are contiguous in their last dim.
    """
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:  # past the last expert's segment
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)  # the arrays hold whole blocks: always in bounds
    row_mask = pairs < num_pairs  # padding rows hold num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # W^T's tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if GATE_UP:
        acc = acc * tl.sigmoid(acc) * acc_up
    if ROUTED:
        acc = acc * tl.load(routing_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------------------------
# Routing layout and block sizes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEBlocks:
    """Compile-time tile sizes of one fused-MoE call."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def choose_blocks(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoEBlocks:
    """Tile sizes from the expected rows per expert (``num_pairs / num_experts``): a host function of shapes."""
    rows = num_pairs / max(num_experts, 1)
    block_m = 16 if rows <= 16 else 64 if rows < 128 else 128
    if dtype == torch.float32:  # exact float32 dots: twice the bytes per tile, no tensor-core fast path
        return MoEBlocks(min(block_m, 64), 32, 32, num_warps=4, num_stages=2)
    # Measured on an H200 with Qwen3-30B-A3B's experts (bf16, E=128, k=8, H=2048, I=768), under CUDA graphs.
    if block_m == 16:  # decode: weight streaming dominates (near the bandwidth floor per GEMM; bench/RESULTS.md)
        return MoEBlocks(16, 64, 128, num_warps=4, num_stages=3)
    if block_m == 64:
        return MoEBlocks(64, 64, 64, num_warps=4, num_stages=3)
    return MoEBlocks(128, 128, 64, num_warps=8, num_stages=3)


def _routing_block(num_pairs: int) -> int:
    """The routing kernels' ``BLOCK``: pairs scanned per iteration (a compile-time size, so a few variants)."""
    return min(max(next_power_of_2(num_pairs), 128), 1024)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int) -> int:
    """Compile every kernel variant ``fused_moe`` can pick for 1 to ``max_tokens`` tokens on these experts' shapes
    (tile configurations and routing block sizes), so that no step compiles one mid-run. Returns the number of
    calls made (one per distinct variant)."""
    num_experts, hidden = w13.shape[0], w13.shape[2]
    seen: dict[tuple, int] = {}
    for num_tokens in range(1, max_tokens + 1):
        pairs = num_tokens * top_k
        seen.setdefault((choose_blocks(pairs, num_experts, w13.dtype), _routing_block(pairs)), num_tokens)
    generator = torch.Generator(device=w13.device).manual_seed(0)
    for num_tokens in seen.values():
        x = torch.randn(num_tokens, hidden, device=w13.device, dtype=w13.dtype, generator=generator)
        top_ids = torch.randint(0, num_experts, (num_tokens, top_k), device=w13.device, generator=generator)
        fused_moe(x, w13, w2, top_ids, torch.full(top_ids.shape, 1.0 / top_k, device=w13.device))
    return len(seen)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded length of ``align_routing``'s layout, a whole number of blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


def align_routing(top_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_ids`` [T, k] -> ``(sorted_pairs, block_experts)``, the layout in the module docstring.

    ``sorted_pairs`` [max_padded_rows] int32: pair ids (``token * k + slot``) sorted by expert, each expert's
    segment padded with ``T * k`` to a multiple of ``block_m``; unused rows at the end hold ``T * k`` too.
    ``block_experts`` [max_padded_rows / block_m] int32: each block's expert, ``-1`` past the last segment.
    Two launches of one program per expert (count, then place), no host sync.
    """
    num_pairs = top_ids.numel()
    device = top_ids.device
    num_rows = max_padded_rows(num_pairs, num_experts, block_m)
    ids = top_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(num_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_rows // block_m, dtype=torch.int32, device=device)
    block = _routing_block(num_pairs)
    _count_kernel[(num_experts,)](ids, counts, num_pairs, BLOCK=block, num_warps=4)
    _align_kernel[(num_experts,)](ids, counts, sorted_pairs, block_experts, num_pairs, num_experts, num_rows,
                                  BLOCK_M=block_m, E_PAD=next_power_of_2(num_experts), BLOCK=block,
                                  num_warps=4)
    return sorted_pairs, block_experts


# --------------------------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    """Exact float32 dots for float32 (the reference's arithmetic); 16-bit inputs are exact in any mode."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch(a, w, out, sorted_pairs, block_experts, routing, num_pairs, n, a_row_div, gate_up, blocks):
    """One grouped GEMM over every block of the layout: ``out[pair, :n]`` from ``a[pair // a_row_div]``."""
    grid = (block_experts.shape[0], cdiv(n, blocks.block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_experts, routing if routing is not None else out, num_pairs, n, a.shape[1],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, GATE_UP=gate_up, ROUTED=routing is not None,
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
        DOT_PRECISION=_dot_precision(a.dtype), num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_ids: torch.Tensor,
              top_weights: torch.Tensor, blocks: MoEBlocks | None = None) -> torch.Tensor:
    """``sum_j top_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with ``e = top_ids[t, j]``.

    x [T, H]; w13 [E, 2I, H] (gate | up); w2 [E, H, I]; top_ids [T, k] (int, each in [0, E)); top_weights
    [T, k] (float32 or x's dtype). Returns [T, H] in x's dtype, like ``FusedExperts``' torch reference.
    ``blocks`` overrides ``choose_blocks``. Safe to capture in a CUDA graph.
    """
    if x.dtype not in SUPPORTED_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: x, w13 and w2 must share one of {SUPPORTED_DTYPES}, got "
                         f"{x.dtype}, {w13.dtype}, {w2.dtype}")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if (w13.shape[2] != hidden or two_inter % 2 or tuple(w2.shape) != (num_experts, hidden, inter)
            or top_ids.shape != top_weights.shape or top_ids.dim() != 2 or top_ids.shape[0] != num_tokens):
        raise ValueError(f"fused_moe: shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 "
                         f"{tuple(w2.shape)}, top_ids {tuple(top_ids.shape)}, top_weights {tuple(top_weights.shape)}")
    top_k = top_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    blocks = blocks or choose_blocks(num_pairs, num_experts, x.dtype)
    sorted_pairs, block_experts = align_routing(top_ids, num_experts, blocks.block_m)
    routing = top_weights.reshape(-1).contiguous()

    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _launch(x, w13, act, sorted_pairs, block_experts, None, num_pairs, inter, top_k, True, blocks)
    out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _launch(act, w2, out, sorted_pairs, block_experts, routing, num_pairs, hidden, 1, False, blocks)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
