"""bf16 products at decode batch sizes: cuBLAS, cuBLASLt and a split-K Triton kernel (needs a CUDA GPU).

    python bench/decode_gemm.py                          # both shapes' projections, batches 1-256
    python bench/decode_gemm.py --shape llama-3.1-8b --batches 151 --sweep

A decode step's four projections read their weights once for a few hundred tokens at most, so they are bound
by memory, and a step of W1 spends ~40% of its device time in them on the 8B shape. Each call is timed inside a
CUDA graph on one of several weight copies in turn, so that no call finds its weight in the L2 cache (as
``fp8_gemm.py`` does). Variants: ``F.linear`` with torch's cuBLAS and with its cuBLASLt backend
(``torch.backends.cuda.preferred_blas_library``); ``W @ x^T`` (the weight rows on cuBLAS's wide side, the output
left transposed); and ``splitk``, the Triton kernel below: C^T = W @ A^T tiles with K split across programs, the
last program of a tile to finish adding the others' float32 partial sums (no second launch). Prints
microseconds and the weight TB/s each reaches; ``--sweep`` lists the Triton kernel's five best tiles.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_gemm import SHAPES, graph_time  # noqa: E402

BATCHES = (1, 32, 64, 128, 151, 256)
L2_BYTES = 50 << 20


@triton.jit(do_not_specialize=["M"])
def _splitk_kernel(a_ptr, w_ptr, c_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_am, stride_wn,
                   stride_cm, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_begin = pid_k * k_per_split
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_begin + offs_k)[None, :]
    a_ptrs = a_ptr + offs_m[None, :] * stride_am + (k_begin + offs_k)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):  # K is a multiple of BLOCK_K * SPLIT
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
        a = tl.load(a_ptrs, mask=m_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]: A^T's tile
        acc = tl.dot(w, a, acc)
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT > 1:
        # Each program leaves its partial sum; the tile's last to arrive adds the others' and writes the output.
        tile = pid_m * tl.num_programs(0) + pid_n
        part_ptrs = part_ptr + (pid_k * tl.num_programs(1) * BLOCK_M + offs_m[None, :]) * N + offs_n[:, None]
        tl.store(part_ptrs, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the release below publishes them
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            for other in range(0, SPLIT):
                if other != pid_k:
                    acc += tl.load(part_ptr + (other * tl.num_programs(1) * BLOCK_M + offs_m[None, :]) * N
                                   + offs_n[:, None], mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)  # ready for the next launch (a graph replays this one)
            tl.store(c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None], acc.to(c_ptr.dtype.element_ty),
                     mask=out_mask)
    else:
        tl.store(c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None], acc.to(c_ptr.dtype.element_ty),
                 mask=out_mask)


class SplitK:
    """``x @ w.T`` by ``_splitk_kernel`` with fixed tiles; owns the partial-sum and counter buffers."""

    def __init__(self, m: int, n: int, k: int, block_n: int, block_m: int, block_k: int, split: int,
                 warps: int, stages: int, device="cuda"):
        if k % (block_k * split):
            raise ValueError(f"K={k} is not a multiple of {block_k} x {split}")
        self.grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
        self.cfg = dict(SPLIT=split, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps,
                        num_stages=stages)
        self.k_per_split = k // split
        self.part = torch.empty(split * self.grid[1] * block_m * n, dtype=torch.float32, device=device)
        self.count = torch.zeros(self.grid[0] * self.grid[1], dtype=torch.int32, device=device)
        self.out = torch.empty(m, n, dtype=torch.bfloat16, device=device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        _splitk_kernel[self.grid](x, w, self.out, self.part, self.count, m, w.shape[0], k, self.k_per_split,
                                  x.stride(0), w.stride(0), self.out.stride(0), **self.cfg)
        return self.out


def default_splitk(m: int, n: int, k: int, num_sms: int) -> SplitK:
    """A tile for the weight rows and enough K splits to give every SM a program or two."""
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 64 if block_m >= 256 else 128
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < num_sms and k % (64 * split * 2) == 0 and k // (split * 2) >= 512:
        split *= 2
    return SplitK(m, n, k, block_n, block_m, 64, split, 4 if block_n * block_m <= 64 * 128 else 8, 4)


def with_blas(library: str, fn):
    def call(*args):
        torch.backends.cuda.preferred_blas_library(library)
        return fn(*args)
    return call


def weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(4, -(-3 * L2_BYTES // (2 * n * k)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]


def timed(fn, x, ws, reps: int = 5) -> float:
    return graph_time([lambda w=w: fn(x, w) for w in ws], reps=reps)


def compare(shape: str, batches) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = ("cuBLAS", "cuBLASLt", "W @ x^T", "splitk")
    print(f"{shape}: us per call / weight TB/s; splitk's tiles (BLOCK_N, BLOCK_M, split) after its time")
    print(f"{'layer':>8} {'batch':>5} " + " ".join(f"{v:>16}" for v in names))
    for name, (n, k) in SHAPES[shape].items():
        ws = weights(n, k)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            splitk = default_splitk(m, n, k, num_sms)
            variants = {
                "cuBLAS": with_blas("cublas", F.linear),
                "cuBLASLt": with_blas("cublaslt", F.linear),
                "W @ x^T": with_blas("cublas", lambda x, w: torch.mm(w, x.t())),
                "splitk": splitk,
            }
            times = []
            for variant, fn in variants.items():
                got = fn(x, ws[0]).float()
                got = got.t() if variant == "W @ x^T" else got
                error = float((got - want).norm() / want.norm())
                if not error < 0.01:
                    print(f"  {name} m={m} {variant}: relative error {error:.4f} against F.linear")
                times.append(timed(fn, x, ws))
            torch.backends.cuda.preferred_blas_library("cublas")
            cells = " ".join(f"{t:>10.1f}/{2 * n * k / (t * 1e-6) / 1e12:>4.2f}" for t in times)
            print(f"{name:>8} {m:>5} {cells}  {splitk.grid[0]}x{splitk.grid[1]}x{splitk.grid[2]} "
                  f"{splitk.cfg['BLOCK_N']}/{splitk.cfg['BLOCK_M']}", flush=True)
        del ws
        torch.cuda.empty_cache()


def sweep(shape: str, batches) -> None:
    for name, (n, k) in SHAPES[shape].items():
        ws = weights(n, k)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            cublas = timed(F.linear, x, ws)
            results = []
            block_ms = [b for b in (16, 32, 64, 128, 256) if b >= min(16, m) and b <= max(16, 2 * m)]
            for bn, bm, bk, split, warps, stages in itertools.product(
                    (32, 64, 128, 256), block_ms, (64, 128), (1, 2, 4, 8), (4, 8), (3, 4, 6)):
                if k % (bk * split) or bn * bm > 128 * 256 or (bn * bm >= 128 * 128 and warps == 4):
                    continue
                try:
                    fn = SplitK(m, n, k, bn, bm, bk, split, warps, stages)
                    error = float((fn(x, ws[0]).float() - want).norm() / want.norm())
                    if not error < 0.01:
                        print(f"  {name} m={m} {fn.cfg}: relative error {error:.4f}")
                        continue
                    results.append((timed(fn, x, ws, reps=3), fn.cfg, fn.grid))
                except Exception as exc:  # out of shared memory or registers for this tile
                    print(f"  skip {bn}/{bm}/{bk} x{split}: {type(exc).__name__}")
            results.sort(key=lambda r: r[0])
            print(f"{name} m={m}: cuBLAS {cublas:.1f} us ({2 * n * k / (cublas * 1e-6) / 1e12:.2f} TB/s)")
            for t, cfg, grid in results[:5]:
                print(f"    {t:7.1f} us {2 * n * k / (t * 1e-6) / 1e12:5.2f} TB/s  grid {grid} {cfg}")
        del ws
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: both")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 1 to 256)")
    args = parser.parse_args()
    torch.manual_seed(0)
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else BATCHES
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for shape in [args.shape] if args.shape else sorted(SHAPES):
        (sweep if args.sweep else compare)(shape, batches)


if __name__ == "__main__":
    main()
