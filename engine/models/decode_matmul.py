"""bf16/fp16 products of decode-sized batches: a split-K Triton kernel in place of cuBLAS where it is faster.

A decode step multiplies a few hundred tokens at most by each weight: the product reads the weight once and is bound
by memory. cuBLAS tiles the output by tokens x weight rows, so a weight of a few thousand rows gives fewer tiles
than the GPU has SMs (Llama-3.1-8B's o_proj, 4,096 x 4,096 at 151 tokens: ~2.1 TB/s of an H200's ~4.2, see
bench/RESULTS.md). Here a program computes one tile of C^T = W @ A^T: up to 128 weight rows on the tensor cores'
wide side and every token of the step on the narrow one, so each weight byte is read by one program, over a slice
of K. K is cut into as many slices as it takes to give every SM a program; the last program of a tile to finish
adds the others' float32 partial sums (kept in a workspace that stays in the L2) and writes the output, so the
product is one launch. A counter per tile, reset by that program, says who is last; the kernel is safe to replay
in a CUDA graph.

``MINIVLLM_DECODE_MATMUL`` picks it: ``triton`` or ``cublas`` (``F.linear`` always), read once per process
(``reread_env``). It applies on CUDA to 16-bit contiguous operands without a bias, up to ``MAX_ROWS`` tokens, where
K is a multiple of ``BLOCK_K``; everything else goes to ``F.linear``.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

MAX_ROWS = 256  # the widest token tile a program takes (the tensor cores' narrow side)
BLOCK_K = 64
CHOICES = ("triton", "cublas")
DEFAULT = "cublas"


# The token count changes every step: not specialized, so no step compiles a variant.
@triton.jit(do_not_specialize=["M"])
def _splitk_kernel(a_ptr, w_ptr, c_ptr, part_ptr, count_ptr, M, N, k_per_split, stride_am, stride_wn, stride_cm,
                   SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_M] tile of C^T = W @ A^T over K's slice ``program_id(2)`` (of SPLIT). The token tiles
    are the grid's first axis: the programs that read one weight tile run side by side and share it in the L2."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * k_per_split + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    a_ptrs = a_ptr + offs_m[None, :] * stride_am + offs_k[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):  # k_per_split is a multiple of BLOCK_K
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
        a = tl.load(a_ptrs, mask=m_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]: A^T's tile
        acc = tl.dot(w, a, acc)
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    out_mask = n_mask[:, None] & m_mask[None, :]
    out_ptrs = c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(c_ptr.dtype.element_ty), mask=out_mask)
    else:
        # The workspace holds [SPLIT, tokens rounded up to BLOCK_M, N] float32 partial sums.
        rows = tl.num_programs(0) * BLOCK_M
        tl.store(part_ptr + (pid_k * rows + offs_m[None, :]) * N + offs_n[:, None], acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial sum is stored before the release below publishes them
        tile = pid_n * tl.num_programs(0) + pid_m
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last of the tile's programs: the others' sums are visible to it
            for other in range(0, SPLIT):
                if other != pid_k:
                    acc += tl.load(part_ptr + (other * rows + offs_m[None, :]) * N + offs_n[:, None],
                                   mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)  # ready for the next launch
            tl.store(out_ptrs, acc.to(c_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class Tiles:
    """``block_n`` weight rows x ``block_m`` tokens a program, K cut into ``split`` slices."""

    block_n: int
    block_m: int
    split: int
    num_warps: int
    num_stages: int

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return triton.cdiv(m, self.block_m), triton.cdiv(n, self.block_n), self.split


def choose_tiles(m: int, n: int, k: int, num_sms: int) -> Tiles | None:
    """The tiles for an [m, k] x [k, n] product, or None where the kernel does not apply (K not a multiple of
    BLOCK_K, or more than MAX_ROWS tokens). The token tile is the batch rounded up to a power of two, so a decode
    step's graph sizes meet a handful of variants; the weight tile narrows as the token tile widens, keeping the
    accumulator at 16k float32 values; K is split until there is a program per SM, keeping slices of 512 or more."""
    if m > MAX_ROWS or k % BLOCK_K:
        return None
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 64 if block_m == 256 else 128
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < num_sms and k % (BLOCK_K * split * 2) == 0 and k // (split * 2) >= 512:
        split *= 2
    return Tiles(block_n, block_m, split, num_warps=8 if block_n * block_m >= 128 * 128 else 4, num_stages=4)


class _Workspace:
    """Float32 partial sums and the tiles' arrival counters of one device, grown when a product needs more; a
    product first met during CUDA graph capture that needs more goes to ``F.linear`` instead (growing would
    allocate from the graph's pool). The engine's warm-up runs every batch size before capture."""

    def __init__(self, device: torch.device):
        self.part = torch.empty(0, dtype=torch.float32, device=device)
        self.count = torch.zeros(0, dtype=torch.int32, device=device)

    def get(self, part_numel: int, count_numel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.part.numel() < part_numel or self.count.numel() < count_numel:
            if self.part.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            if self.part.numel() < part_numel:
                self.part = torch.empty(part_numel, dtype=torch.float32, device=self.part.device)
            if self.count.numel() < count_numel:
                self.count = torch.zeros(count_numel, dtype=torch.int32, device=self.count.device)
        return self.part, self.count


_workspaces: dict[torch.device, _Workspace] = {}


def splitk_matmul(x: torch.Tensor, weight: torch.Tensor, tiles: Tiles,
                  out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ weight.T`` ([m, k] x [n, k], both with unit column stride) by the split-K kernel with ``tiles``; None
    where the workspace cannot grow (during capture)."""
    m, k = x.shape
    n = weight.shape[0]
    grid = tiles.grid(m, n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    part, count = out, out  # not read with one slice
    if tiles.split > 1:
        workspace = _workspaces.get(x.device)
        if workspace is None:
            workspace = _workspaces[x.device] = _Workspace(x.device)
        got = workspace.get(tiles.split * grid[0] * tiles.block_m * n, grid[0] * grid[1])
        if got is None:
            return None
        part, count = got
    _splitk_kernel[grid](x, weight, out, part, count, m, n, k // tiles.split, x.stride(0), weight.stride(0),
                         out.stride(0), SPLIT=tiles.split, BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m,
                         BLOCK_K=BLOCK_K, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def choice_from_env() -> str:
    """``MINIVLLM_DECODE_MATMUL``; an unknown value is an error naming the choices."""
    value = os.environ.get("MINIVLLM_DECODE_MATMUL", DEFAULT).strip().lower()
    if value not in CHOICES:
        raise ValueError(f"MINIVLLM_DECODE_MATMUL must be one of {list(CHOICES)}, got {value!r}")
    return value


@functools.cache
def _enabled() -> bool:
    choice = choice_from_env()
    logger.info("decode-sized bf16 products: %s (MINIVLLM_DECODE_MATMUL)",
                "the split-K Triton kernel" if choice == "triton" else "cuBLAS")
    return choice == "triton"


def reread_env() -> None:
    """Forget the choice read from ``MINIVLLM_DECODE_MATMUL`` (for benchmarks and tests that compare both)."""
    _enabled.cache_clear()


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the split-K kernel where it applies and is chosen."""
    if (bias is None and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1 and weight.stride(1) == 1
            and _enabled()):
        device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        tiles = choose_tiles(x.shape[0], weight.shape[0], x.shape[1], _num_sms(device_index))
        if tiles is not None and x.shape[0] > 0:
            out = splitk_matmul(x, weight, tiles)
            if out is not None:
                return out
    return F.linear(x, weight, bias)
