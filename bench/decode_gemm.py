"""bf16 products at decode batch sizes: cuBLAS, cuBLASLt, cuBLAS split along K and a split-K Triton kernel (needs
a CUDA GPU).

    python bench/decode_gemm.py                          # both shapes' projections, batches 1-256
    python bench/decode_gemm.py --shape llama-3.1-8b --batches 151 --sweep
    python bench/decode_gemm.py --ksplit --batches 64,151,256   # cuBLAS against cuBLAS cut along K only, and the
                                                                # MINIVLLM_DECODE_KSPLIT it suggests per shape

A decode step's four projections read their weights once for a few hundred tokens at most, so they are bound
by memory, and a step of W1 spends ~40% of its device time in them on the 8B shape. Each call is timed inside a
CUDA graph on one of several weight copies in turn, so that no call finds its weight in the L2 cache (as
``fp8_gemm.py`` does). Variants: ``F.linear`` with torch's cuBLAS and with its cuBLASLt backend
(``torch.backends.cuda.preferred_blas_library``); ``W @ x^T`` (the weight rows on cuBLAS's wide side, the output
left transposed); ``splitk``, the kernel below, with the tiles ``choose_tiles`` picks and the best of their
neighbours; and cuBLAS itself split along K (``ksplit_partials``: a strided-batched product of K's slices, more
programs with shorter K loops, partial products a following kernel would add), with its best slice count. Prints
microseconds and the weight TB/s each reaches; ``--sweep`` lists the split-K kernel's five best tiles. The split-K
kernel lost to cuBLAS at every batch of 64 tokens and more (bench/RESULTS.md, 2026-12-05), so the engine does not
use it.

The kernel: a program computes one tile of C^T = W @ A^T, up to 128 weight rows on the tensor cores' wide side
and every token of the step on the narrow one, over a slice of K; K is cut into as many slices as it takes to give
every SM a program, and the last program of a tile to finish adds the others' float32 partial sums (kept in a
workspace) and writes the output, so the product is one launch. A counter per tile, reset by that program, says
who is last, so the kernel replays in a CUDA graph.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_gemm import L2_BYTES, SHAPES, graph_time, print_sweep  # noqa: E402  (puts the repo root on the path)

from engine.models.linear.unquantized import k_slice_products  # noqa: E402

BATCHES = (1, 32, 64, 128, 151, 256)
MAX_ROWS = 256  # the widest token tile a program takes (the tensor cores' narrow side)
BLOCK_K = 64
KSPLIT_MARGIN = 0.05  # --ksplit suggests a cut only where it saves at least this share of cuBLAS's time


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


def choose_tiles(m: int, n: int, k: int, num_sms: int) -> Tiles:
    """The tiles for an [m, k] x [k, n] product (m <= MAX_ROWS, k a multiple of BLOCK_K). The token tile is the batch
    rounded up to a power of two, so a decode step's graph sizes would meet a handful of variants; the weight tile
    narrows as the token tile widens, keeping the accumulator at 16k float32 values; K is split until there is a
    program per SM, keeping slices of 512 or more."""
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 64 if block_m == 256 else 128
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < num_sms and k % (BLOCK_K * split * 2) == 0 and k // (split * 2) >= 512:
        split *= 2
    return Tiles(block_n, block_m, split, num_warps=8 if block_n * block_m >= 128 * 128 else 4, num_stages=4)


def splitk(m: int, n: int, k: int, tiles: Tiles, device="cuda"):
    """``x @ w.T`` for [m, k] inputs and [n, k] weights by the split-K kernel with ``tiles``: a closure that owns its
    output, the float32 partial sums ([split, m rounded up to the token tile, n]) and the tiles' arrival counters."""
    grid = tiles.grid(m, n)
    out = torch.empty(m, n, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    part = torch.empty(tiles.split * grid[0] * tiles.block_m * n, dtype=torch.float32, device=device)
    count = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=device)

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _splitk_kernel[grid](x, w, out, part, count, m, n, k // tiles.split, x.stride(0), w.stride(0), out.stride(0),
                             SPLIT=tiles.split, BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m, BLOCK_K=BLOCK_K,
                             num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        return out

    return product


def ksplit_partials(split: int):
    """cuBLAS cut along K into ``split`` slices, as the engine runs it (``layers.k_slice_products``): [split, m, n]
    partial products (bf16, each rounded once) whose sum is the result; the kernel that reads the product next adds
    them as it reads them (the KV-cache write after q|k|v, the residual add-norm after o and down, SwiGLU after
    gate|up)."""
    return lambda x, w: k_slice_products(x, w, split)


def ksplits(k: int) -> list[int]:
    """The slice counts ``ksplit_partials`` is timed with: 2 to 8 slices of a multiple of 128 columns."""
    return [s for s in (2, 3, 4, 6, 8) if k % (128 * s) == 0]


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


def neighbours(tiles: Tiles, k: int) -> list[Tiles]:
    """The pick with the other weight-tile width and half or twice its K slices: what ``compare`` also times."""
    out = []
    for block_n in (64, 128):
        for split in (tiles.split // 2, tiles.split, tiles.split * 2):
            if split < 1 or k % (BLOCK_K * split) or (block_n, split) == (tiles.block_n, tiles.split):
                continue
            warps = 8 if block_n * tiles.block_m >= 128 * 128 else 4
            out.append(Tiles(block_n, tiles.block_m, split, warps, 4 if block_n * tiles.block_m < 128 * 256 else 3))
    return out


def compare(shape: str, batches) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = ("cuBLAS", "cuBLASLt", "W @ x^T", "splitk", "best near it", "K-split bmm", "bmm + sum")
    print(f"{shape}: us per call / weight TB/s; then choose_tiles' pick and the best of its neighbours, and the "
          f"slice count of the best cuBLAS K-split (its partial products; then with a separate sum)")
    print(f"{'layer':>8} {'batch':>5} " + " ".join(f"{v:>16}" for v in names))
    for name, (n, k) in SHAPES[shape].items():
        ws = weights(n, k)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            tiles = choose_tiles(m, n, k, num_sms)
            variants = {
                "cuBLAS": with_blas("cublas", F.linear),
                "cuBLASLt": with_blas("cublaslt", F.linear),
                "W @ x^T": with_blas("cublas", lambda x, w: torch.mm(w, x.t())),
                "splitk": splitk(m, n, k, tiles),
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
            best = (float("inf"), None)
            for other in neighbours(tiles, k):
                try:
                    best = min(best, (timed(splitk(m, n, k, other), x, ws, reps=3), other), key=lambda r: r[0])
                except Exception as exc:  # out of shared memory or registers for this tile
                    print(f"  skip {other}: {type(exc).__name__}")
            times.append(best[0])
            split_best = (float("inf"), None)
            for split in ksplits(k):
                fn = ksplit_partials(split)
                error = float((fn(x, ws[0]).float().sum(0) - want).norm() / want.norm())
                if not error < 0.01:
                    print(f"  {name} m={m} K-split {split}: relative error {error:.4f} against F.linear")
                split_best = min(split_best, (timed(fn, x, ws), split), key=lambda r: r[0])
            if split_best[1] is None:
                times += [float("nan")] * 2
            else:
                partials = ksplit_partials(split_best[1])
                times += [split_best[0], timed(lambda x, w: partials(x, w).sum(0), x, ws)]
            cells = " ".join(f"{t:>10.1f}/{2 * n * k / (t * 1e-6) / 1e12:>4.2f}" for t in times)
            print(f"{name:>8} {m:>5} {cells}  {tiles} | {best[1]} | K in {split_best[1]}", flush=True)
        del ws
        torch.cuda.empty_cache()


def compare_ksplit(shape: str, batches) -> str:
    """cuBLAS (and cuBLASLt) against cuBLAS cut along K at every slice count ``ksplits`` allows, each product as the
    engine runs it with ``MINIVLLM_DECODE_KSPLIT`` (its partial products, which the next kernel adds as it reads
    them). No Triton kernel is compiled. Returns the setting it suggests for ``shape`` on this GPU: each product at
    the slice count with the least time summed over ``batches``, where that beats cuBLAS's sum by ``KSPLIT_MARGIN``
    (else the product stays whole); "0" when none does."""
    print(f"{shape}: us per call / weight TB/s; cuBLAS cut along K into S slices (partial products)")
    counts = []
    for name, (n, k) in SHAPES[shape].items():
        ws = weights(n, k)
        totals: dict[int, float] = {}  # slice count (1: cuBLAS whole) -> microseconds summed over the batches
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            cells = []
            for label, fn in [("cuBLAS", with_blas("cublas", F.linear)), ("cuBLASLt", with_blas("cublaslt", F.linear))]:
                t = timed(fn, x, ws)
                cells.append(f"{label} {t:.1f}/{2 * n * k / (t * 1e-6) / 1e12:.2f}")
                if label == "cuBLAS":
                    totals[1] = totals.get(1, 0.0) + t
            torch.backends.cuda.preferred_blas_library("cublas")
            for split in ksplits(k):
                fn = ksplit_partials(split)
                error = float((fn(x, ws[0]).float().sum(0) - want).norm() / want.norm())
                t = timed(fn, x, ws)
                totals[split] = totals.get(split, 0.0) + t
                cells.append(f"S={split} {t:.1f}/{2 * n * k / (t * 1e-6) / 1e12:.2f}"
                             + ("" if error < 0.01 else f" (relative error {error:.4f})"))
            print(f"{name:>8} {m:>5}  " + "  ".join(cells), flush=True)
        best = min(totals, key=totals.get)
        if best > 1 and totals[best] < (1 - KSPLIT_MARGIN) * totals[1]:
            counts.append(f"{name}={best}")
        print(f"{name:>8} summed over the batches: cuBLAS {totals[1]:.1f} us, best "
              + ("cuBLAS whole" if best == 1 else f"S={best} {totals[best]:.1f} us"))
        del ws
        torch.cuda.empty_cache()
    setting = ",".join(counts) or "0"
    print(f"{shape}: suggested MINIVLLM_DECODE_KSPLIT={setting}")
    return setting


def sweep(shape: str, batches, layers) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in SHAPES[shape].items():
        if layers and name not in layers:
            continue
        ws = weights(n, k)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            cublas = timed(F.linear, x, ws)
            results = []
            widest = max(16, triton.next_power_of_2(m))
            block_ms = [b for b in (16, 32, 64, 128, 256) if widest // 4 <= b <= widest]
            for bn, bm, split in itertools.product((32, 64, 128, 256), block_ms, (1, 2, 4, 8)):
                if k % (BLOCK_K * split) or bn * bm > 128 * 256:
                    continue
                for stages in (4, 3):  # 3 where 4 stages do not fit the shared memory
                    tiles = Tiles(bn, bm, split, 8 if bn * bm >= 128 * 128 else 4, stages)
                    try:
                        fn = splitk(m, n, k, tiles)
                        error = float((fn(x, ws[0]).float() - want).norm() / want.norm())
                        if not error < 0.01:
                            print(f"  {name} m={m} {tiles}: relative error {error:.4f}")
                            break
                        results.append((timed(fn, x, ws, reps=3), tiles))
                        break
                    except Exception as exc:  # out of shared memory or registers for this tile
                        print(f"  skip {tiles}: {type(exc).__name__}")
            print_sweep(f"{name} m={m}: cuBLAS {cublas:.1f} us ({2 * n * k / (cublas * 1e-6) / 1e12:.2f} TB/s); "
                        f"choose_tiles' pick", results, choose_tiles(m, n, k, num_sms), weight_bytes=2 * n * k)
        del ws
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: both")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--ksplit", action="store_true",
                        help="cuBLAS against cuBLAS cut along K at each slice count only (no Triton kernel)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 1 to 256)")
    parser.add_argument("--layers", default=None, help="--sweep: comma-separated projections (qkv,o,gate_up,down)")
    args = parser.parse_args()
    torch.manual_seed(0)
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else BATCHES
    if max(batches) > MAX_ROWS:
        parser.error(f"--batches: decode sizes of at most {MAX_ROWS} tokens")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for shape in [args.shape] if args.shape else sorted(SHAPES):
        if args.sweep:
            sweep(shape, batches, args.layers.split(",") if args.layers else None)
        elif args.ksplit:
            compare_ksplit(shape, batches)
        else:
            compare(shape, batches)


if __name__ == "__main__":
    main()
