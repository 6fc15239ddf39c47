"""Decode-sized bf16 products: cuBLAS's own pick (``F.linear``), the engine's K-split and every algorithm
cuBLASLt offers, each timed (needs a CUDA GPU).

    python bench/lt_products.py                              # both shapes, 64 / 151 / 256 tokens
    python bench/lt_products.py --shape qwen3-0.6b --batches 151 --candidates 64 --top 5

At a few hundred tokens each product reads its weight once and is bound by memory, yet on Qwen3-0.6B's shapes
cuBLAS takes ~6-8 us whatever the weight's size (bench/RESULTS.md, 2026-12-05). The question here: does another
of the algorithms cuBLASLt offers for the shape (``cublaslt.py`` beside this file: tiles, stages, split-K with its
reduction) do better than the one cuBLAS picks? Each is timed inside CUDA graphs on weight copies that do not fit
the L2 (as ``decode_gemm.py`` does), the fastest is checked against ``F.linear``, and the table gives us per call
and weight TB/s: ``F.linear``, the engine's K-split (``layers.k_slice_products``, partial products a later kernel
adds; best of 2 and 4 slices where K is at least the output's width), cuBLASLt's first pick, and the best
candidate with its ``id/tile/stages/splitK/reduction/cluster``. ``--top N`` lists the N best candidates. On an
H100 (bench/RESULTS.md, 2026-12-06) no candidate beat cuBLAS's pick by more than 0.5 us on Qwen3-0.6B's products,
so the engine keeps ``F.linear`` and its K-split.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cublaslt  # noqa: E402
from decode_gemm import weights  # noqa: E402
from fp8_gemm import SHAPES, graph_time  # noqa: E402  (puts the repo root on the path)

from engine.models.linear.unquantized import k_slice_products  # noqa: E402


def time_candidates(product: cublaslt.LtProduct, x: torch.Tensor, ws: list[torch.Tensor], count: int,
                    reps: int) -> list[tuple[float, int, object]]:
    """(us per call, rank in cuBLASLt's list, algorithm) of every candidate that runs, fastest first."""
    out = torch.empty(product.m, product.n, dtype=x.dtype, device=x.device)
    timed = []
    for rank, algo in enumerate(product.candidates(count)):
        try:
            product.run(x, ws[0], out, algo)
            torch.cuda.synchronize()
        except cublaslt.CublasLtError:
            continue
        timed.append((graph_time([lambda w=w, a=algo: product.run(x, w, out, a) for w in ws], reps=reps), rank,
                      algo))
    return sorted(timed, key=lambda t: t[0])


def compare(shape: str, batches, count: int, top: int, reps: int) -> None:
    print(f"{shape}: us per call / weight TB/s")
    names = ("F.linear", "K-split", "Lt first", "Lt best")
    print(f"{'layer':>8} {'batch':>5} " + " ".join(f"{v:>13}" for v in names) + "  best: rank id/tile/stages/splitK/"
          "reduction/cluster (candidates)")
    for name, (n, k) in SHAPES[shape].items():
        ws = weights(n, k)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            times = [graph_time([lambda w=w: F.linear(x, w) for w in ws], reps=reps)]
            splits = [s for s in (2, 4) if k >= n and k % (128 * s) == 0]
            times.append(min((graph_time([lambda w=w, s=s: k_slice_products(x, w, s) for w in ws], reps=reps)
                              for s in splits), default=float("nan")))
            product = cublaslt.LtProduct(m, n, k, torch.bfloat16)
            ranked = time_candidates(product, x, ws, count, reps)
            first = next((t for t in ranked if t[1] == 0), None)
            times += [first[0] if first else float("nan"), ranked[0][0] if ranked else float("nan")]
            note = "no candidate ran"
            if ranked:
                out = torch.empty(m, n, dtype=x.dtype, device=x.device)
                product.run(x, ws[0], out, ranked[0][2])
                error = float((out.float() - want).norm() / want.norm())
                note = f"{ranked[0][1]:>2} {cublaslt.describe(ranked[0][2])} ({len(ranked)})"
                if not error < 0.01:
                    note += f"  WRONG: relative error {error:.4f} against F.linear"
            cells = " ".join(f"{t:>7.1f}/{2 * n * k / (t * 1e-6) / 1e12:>5.2f}" for t in times)
            print(f"{name:>8} {m:>5} {cells}  {note}", flush=True)
            for t, rank, algo in ranked[1:top]:
                print(f"{'':>15} {t:>7.1f} us  rank {rank:>2} {cublaslt.describe(algo)}")
        del ws
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: both")
    parser.add_argument("--batches", default="64,151,256", help="comma-separated token counts")
    parser.add_argument("--candidates", type=int, default=32, help="how many algorithms to ask cuBLASLt for")
    parser.add_argument("--top", type=int, default=1, help="list this many of the fastest candidates")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "CUDA", torch.version.cuda,
          cublaslt._library_path())
    for shape in [args.shape] if args.shape else sorted(SHAPES, reverse=True):
        compare(shape, tuple(int(b) for b in args.batches.split(",")), args.candidates, args.top, args.reps)


if __name__ == "__main__":
    main()
