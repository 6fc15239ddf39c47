"""int4 (W4A16) and int8 weight products on a CUDA GPU against the 16-bit product they replace.

    python bench/quant_gemm.py                                  # Llama-3.1-8B and Qwen3-0.6B, batches 1-4096
    python bench/quant_gemm.py --shape llama-3.1-8b --sweep     # the kernel's tiles swept per projection and batch
    python bench/quant_gemm.py --sweep --gemv --batches 1,4     # the few-token GEMV's tiles

For each projection and token count: ``F.linear`` with a bfloat16 W (cuBLAS), the int4 kernel of
``engine.ops.quant_matmul`` with the kernel and tiles ``choose_product_tiles`` picks (the GEMV of
``engine.ops.quant_gemv`` up to four tokens; group 128, AWQ/GPTQ's usual, and group 32, GGUF Q4's), the tensor-core
kernel at group 128 where the GEMV took the product ("TC"), the int8 kernel (group 32, GGUF Q8_0's), and W
dequantized then multiplied on cuBLAS (what products of ``DEQUANTIZE_FROM_ROWS`` tokens or more do). Microseconds
per call and the weight bytes per second each reaches (codes + scales + zeros for the quantized ones), every call
timed in a CUDA graph on one of several weight copies so that none finds its weight in the L2 cache
(``fp8_gemm.graph_time``). ``--sweep`` lists the five fastest tiles per product and where the pick of
``choose_tiles`` (``--gemv``: ``choose_product_tiles``) ranks.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_gemm import L2_BYTES, SHAPES, graph_time, print_sweep  # noqa: E402  (puts the repo root on the path)

from engine.models.linear.int4 import pack_int4  # noqa: E402
from engine.ops.quant_gemv import GemvTiles  # noqa: E402
from engine.ops.quant_matmul import (  # noqa: E402
    QuantWeight,
    Tiles,
    choose_product_tiles,
    choose_tiles,
    dequantize,
    quant_matmul,
)

BATCHES = (1, 2, 4, 8, 32, 64, 128, 256, 512, 1024, 4096)


def quant_weights(n: int, k: int, bits: int, group: int) -> list[QuantWeight]:
    """Random codes with scales and zeros in bfloat16, as many copies as keep the L2 cache from holding one."""
    one = n * k * bits // 8 + 2 * 2 * n * (k // group)
    out = []
    for _ in range(max(4, -(-3 * L2_BYTES // one))):
        if bits == 4:
            codes = pack_int4(torch.randint(0, 16, (n, k), device="cuda"))
        else:
            codes = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
        scales = torch.rand(n, k // group, device="cuda").mul_(0.004).add_(0.001).to(torch.bfloat16)
        zeros = torch.randn(n, k // group, device="cuda").mul_(0.01).to(torch.bfloat16) if bits == 4 else None
        out.append(QuantWeight(codes, scales, zeros, bits, group))
    return out


def weight_bytes(w: QuantWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.codes, w.scales, w.zeros) if t is not None)


def dense_weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(4, -(-3 * L2_BYTES // (2 * n * k)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]


def compare(shape: str, batches) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = ("bf16 cuBLAS", "int4 g128", "int4 g128 TC", "int4 g32", "int8 g32", "deq g128+cuBLAS")
    print(f"{shape}: us per call / weight TB/s (the bytes each variant reads: bf16 W, or codes + scales + zeros)")
    print(f"{'layer':>8} {'batch':>5} " + " ".join(f"{v:>16}" for v in names) + "  bf16/int4 g128")
    for name, (n, k) in SHAPES[shape].items():
        dense = dense_weights(n, k)
        variants = {"int4 g128": quant_weights(n, k, 4, 128), "int4 g32": quant_weights(n, k, 4, 32),
                    "int8 g32": quant_weights(n, k, 8, 32)}
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cells = [(graph_time([lambda w=w: F.linear(x, w) for w in dense]), 2 * n * k)]
            for label, ws in variants.items():
                check(x, ws[0], label, name, m)
                tiles = choose_product_tiles(m, n, k, ws[0].group, ws[0].bits, num_sms)
                cells.append((graph_time([lambda w=w: quant_matmul(x, w, tiles) for w in ws]), weight_bytes(ws[0])))
                if label == "int4 g128":  # the tensor-core kernel, where the GEMV took the product
                    tc = choose_tiles(m, n, k, ws[0].group, num_sms)
                    cells.append((graph_time([lambda w=w: quant_matmul(x, w, tc) for w in ws]), weight_bytes(ws[0])))
            ws = variants["int4 g128"]
            cells.append((graph_time([lambda w=w: F.linear(x, dequantize(w, x.dtype)) for w in ws]),
                          weight_bytes(ws[0])))
            text = " ".join(f"{t:>10.1f}/{b / (t * 1e-6) / 1e12:>4.2f}" for t, b in cells)
            print(f"{name:>8} {m:>5} {text}  {cells[0][0] / cells[1][0]:.2f}x", flush=True)
        del dense, variants
        torch.cuda.empty_cache()


def check(x: torch.Tensor, w: QuantWeight, label: str, name: str, m: int) -> None:
    want = F.linear(x.float(), dequantize(w, torch.bfloat16).float())
    error = float((quant_matmul(x, w).float() - want).norm() / want.norm())
    if not error < 0.01:
        print(f"  {name} m={m} {label}: relative error {error:.4f} against the dequantized product")


def candidates(m: int, k: int, group: int):
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    for block_n, block_k, split, stages, warps in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16),
                                                                     (3, 4), (4, 8)):
        if k % (block_k * split) or (k // (block_k * split)) < 2 or (block_k % group and group % block_k):
            continue
        if warps == 8 and block_n < 128:
            continue
        yield Tiles(block_m, block_n, block_k, split, warps, stages)


def gemv_candidates(m: int, k: int, group: int):
    for block_n, block_k, split, warps in itertools.product((8, 16, 32, 64), (128, 256, 512), (1, 2, 4, 8, 16),
                                                            (2, 4, 8)):
        if k % (block_k * split) or (block_k % group and group % block_k) or block_n * block_k > 16384:
            continue
        yield GemvTiles(block_n, block_k, split, warps)


def sweep(shape: str, batches, group: int, gemv: bool) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in SHAPES[shape].items():
        ws = quant_weights(n, k, 4, group)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            results = []
            chosen = choose_product_tiles(m, n, k, group, 4, num_sms) if gemv else choose_tiles(m, n, k, group,
                                                                                                  num_sms)
            for tiles in (gemv_candidates if gemv else candidates)(m, k, group):
                try:
                    results.append((graph_time([lambda w=w: quant_matmul(x, w, tiles) for w in ws], reps=3), tiles))
                except Exception as exc:  # out of shared memory or registers for this tile
                    print(f"  skip {tiles}: {type(exc).__name__}")
            print_sweep(f"{name} m={m} int4 g{group}: {'GEMV' if gemv else 'tensor-core'} tiles chosen", results,
                        chosen, weight_bytes(ws[0]))
        del ws
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append")
    parser.add_argument("--batches", default=None, help="token counts, comma-separated")
    parser.add_argument("--sweep", action="store_true", help="sweep the int4 kernel's tiles")
    parser.add_argument("--group", type=int, default=128, help="int4 group size of --sweep")
    parser.add_argument("--gemv", action="store_true", help="--sweep the few-token GEMV's tiles instead")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")] if args.batches else BATCHES
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    for shape in args.shape or ("llama-3.1-8b", "qwen3-0.6b"):
        sweep(shape, batches, args.group, args.gemv) if args.sweep else compare(shape, batches)


if __name__ == "__main__":
    main()
