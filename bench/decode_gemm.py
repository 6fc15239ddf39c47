"""bf16 products at decode batch sizes: cuBLAS, cuBLASLt and a split-K Triton kernel (needs a CUDA GPU).

    python bench/decode_gemm.py                          # both shapes' projections, batches 1-256
    python bench/decode_gemm.py --shape llama-3.1-8b --batches 151 --sweep

A decode step's four projections read their weights once for a few hundred tokens at most, so they are bound
by memory, and a step of W1 spends ~40% of its device time in them on the 8B shape. Each call is timed inside a
CUDA graph on one of several weight copies in turn, so that no call finds its weight in the L2 cache (as
``fp8_gemm.py`` does). Variants: ``F.linear`` with torch's cuBLAS and with its cuBLASLt backend
(``torch.backends.cuda.preferred_blas_library``); ``W @ x^T`` (the weight rows on cuBLAS's wide side, the output
left transposed); and ``splitk``, ``engine.models.decode_matmul``'s kernel with the tiles it picks. Prints
microseconds and the weight TB/s each reaches; ``--sweep`` lists the split-K kernel's five best tiles and the
engine's pick.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_gemm import SHAPES, graph_time  # noqa: E402

from engine.models.decode_matmul import BLOCK_K, Tiles, choose_tiles, splitk_matmul  # noqa: E402

BATCHES = (1, 32, 64, 128, 151, 256)
L2_BYTES = 50 << 20


def splitk(m: int, n: int, k: int, tiles: Tiles):
    """The engine's split-K product with ``tiles``, its workspace grown before any graph capture."""
    if tiles is None:
        return None
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    fn = lambda x, w: splitk_matmul(x, w, tiles, out)  # noqa: E731
    fn.tiles = tiles
    return fn


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
    names = ("cuBLAS", "cuBLASLt", "W @ x^T", "splitk", "best near it")
    print(f"{shape}: us per call / weight TB/s; then the engine's tiles and the best of their neighbours")
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
            cells = " ".join(f"{t:>10.1f}/{2 * n * k / (t * 1e-6) / 1e12:>4.2f}" for t in times)
            print(f"{name:>8} {m:>5} {cells}  {tiles} | {best[1]}", flush=True)
        del ws
        torch.cuda.empty_cache()


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
            results.sort(key=lambda r: r[0])
            pick = choose_tiles(m, n, k, num_sms)
            picked = next((t for t, c in results if c == pick), None)
            print(f"{name} m={m}: cuBLAS {cublas:.1f} us ({2 * n * k / (cublas * 1e-6) / 1e12:.2f} TB/s); "
                  f"engine's pick {pick} -> {picked}")
            for t, tiles in results[:5]:
                print(f"    {t:7.1f} us {2 * n * k / (t * 1e-6) / 1e12:5.2f} TB/s  {tiles}")
        del ws
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: both")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 1 to 256)")
    parser.add_argument("--layers", default=None, help="--sweep: comma-separated projections (qkv,o,gate_up,down)")
    args = parser.parse_args()
    torch.manual_seed(0)
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else BATCHES
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for shape in [args.shape] if args.shape else sorted(SHAPES):
        if args.sweep:
            sweep(shape, batches, args.layers.split(",") if args.layers else None)
        else:
            compare(shape, batches)


if __name__ == "__main__":
    main()
