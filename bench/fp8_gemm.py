"""FP8 linear layers against bf16 ones, at decode and prefill batch sizes (the H200 numbers in bench/RESULTS.md).

    python bench/fp8_gemm.py                       # Llama-3.1-8B's projections
    python bench/fp8_gemm.py --shape qwen3-0.6b
    python bench/fp8_gemm.py --sweep               # the Triton kernel's tiles and K splits, best first

Each call is timed inside a CUDA graph (no launch cost), on one of several copies of the weight in turn, so
that no call finds its weight in the 50 MB L2 cache as a decode step would not. For each projection (q|k|v, o,
gate|up, down) and batch size: bf16 ``F.linear`` and FP8 products on per-channel weights, each with the
activations' quantization: ``torch._scaled_mm`` with one activation scale per token; the Triton
``scaled_matmul``; cuBLAS's block-scaled ``_scaled_mm`` with 1 x 128 weight scales and
with 128 x 128 tiles of ones followed by the per-channel scales; and what ``fp8_linear`` picks. Prints
microseconds and the weight bytes per second each reaches, and any product more than 6% from bf16's.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models import fp8
from engine.ops import fp8 as fp8_kernels  # noqa: E402

SHAPES = {
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
}
BATCHES = (1, 8, 32, 64, 128, 151, 256, 512, 1024, 2048, 4096, 16384)
L2_BYTES = 50 << 20


def graph_time(calls, reps: int = 5) -> float:
    """Microseconds per call: ``calls`` (a list of closures, each on its own weight copy) captured in one
    CUDA graph, replayed ``reps`` times, median."""
    for fn in calls[:2]:
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def copies_needed(n: int, k: int) -> int:
    """Enough FP8 weight copies that cycling through them spills the L2 (at least 4, calls >= 8)."""
    return max(4, -(-3 * L2_BYTES // (n * k)))


def weights(n: int, k: int, copies: int):
    """``copies`` random weights, each as a dict: bf16, and FP8 per channel (values, scales and their cuBLAS
    layouts)."""
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        values, scales = fp8.quantize_per_channel(w)
        out.append(dict(bf16=w, values=values, scales=scales, cublas=fp8.cublas_weight_scales(values, scales, None)))
    return out


VARIANTS = {
    "bf16 F.linear": lambda x, w: F.linear(x, w["bf16"]),
    "per token": lambda x, w: _scaled_mm_per_token(x, w["values"], w["scales"]),
    "Triton": lambda x, w: fp8._gpu_fp8_linear(x, w["values"], w["scales"], None),
    "1x128": lambda x, w: _scaled_mm_blocks(x, w["values"], w["cublas"].groups),
    "128x128 ones": lambda x, w: _scaled_mm_blocks(x, w["values"], w["cublas"].tiles),
    "128x128 torch*rows": lambda x, w: _scaled_mm_blocks(x, w["values"], w["cublas"].tiles).mul_(
        w["scales"].to(x.dtype)),
    "128x128 Triton*rows": lambda x, w: fp8_kernels.scale_columns_(
        _scaled_mm_blocks(x, w["values"], w["cublas"].tiles), w["scales"]),
    "engine": lambda x, w: fp8._gpu_fp8_linear(x, w["values"], w["scales"], None, w["cublas"]),
}
NOT_A_PRODUCT = ("bf16 F.linear", "128x128 ones")  # left out of the best-FP8 ratio


def compare(shape: str, batches) -> None:
    print(f"{shape}: us per call / weight TB/s (bf16 counts 2 bytes a weight, FP8 one); FP8 weights per channel. "
          f"'per token': one activation scale per token, the rest one per token and 128 columns. '1x128': cuBLAS "
          f"with the weight scales per row and 128 columns; '128x128 ones': cuBLAS's 128 x 128 kernels with tiles "
          f"of ones, '*rows' then the per-channel scales on the output (torch's multiply or the engine's Triton "
          f"kernel); 'engine': what fp8_linear runs")
    print(f"{'layer':>8} {'batch':>5} " + " ".join(f"{v:>19}" for v in VARIANTS) + f" {'best FP8':>10}")
    for name, (n, k) in SHAPES[shape].items():
        ws = weights(n, k, copies_needed(n, k))
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times = []
            want = F.linear(x, ws[0]["bf16"]).float()
            for variant, fn in VARIANTS.items():
                try:
                    got = fn(x, ws[0]).float()
                    error = float((got - want).norm() / want.norm())
                    if not error < (0.06 if variant != "128x128 ones" else 1e9):
                        print(f"  {name} m={m} {variant}: relative error {error:.4f} against bf16")
                    times.append(graph_time([lambda w=w, fn=fn: fn(x, w) for w in ws]))
                except (RuntimeError, ValueError) as exc:
                    print(f"  {name} m={m} {variant}: {type(exc).__name__}: {str(exc)[:200]}")
                    times.append(float("nan"))
            rates = [n * k * (2 if i == 0 else 1) / (t * 1e-6) / 1e12 for i, t in enumerate(times)]
            cells = " ".join(f"{t:>13.1f}/{r:>4.2f}" for t, r in zip(times, rates))
            fp8_times = [t for t, v in zip(times, VARIANTS) if v not in NOT_A_PRODUCT and t == t]
            print(f"{name:>8} {m:>5} {cells} {times[0] / min(fp8_times):>9.2f}x", flush=True)
        del ws
        torch.cuda.empty_cache()


def _scaled_mm_blocks(x, values, weight_scales):
    xq, xs = fp8_kernels.quantize_rows(x, fp8.ACTIVATION_GROUP, cublas_layout=True)
    return torch._scaled_mm(xq, values.t(), scale_a=xs, scale_b=weight_scales, out_dtype=x.dtype)[: x.shape[0]]


def _scaled_mm_per_token(x, values, scales):
    xq, xs = fp8_kernels.quantize_rows(x)
    return torch._scaled_mm(xq, values.t(), scale_a=xs, scale_b=scales.view(1, -1), out_dtype=x.dtype)


def print_sweep(title: str, results: list, pick, weight_bytes: int) -> None:
    """The five fastest of ``results`` ((us, tiles) pairs) with the weight TB/s each reaches, after a line with
    ``title`` and the time of ``pick`` (a heuristic's tiles) among them."""
    results = sorted(results, key=lambda r: r[0])
    print(f"{title} {pick} -> {next((t for t, c in results if c == pick), None)}")
    for t, tiles in results[:5]:
        print(f"    {t:7.1f} us {weight_bytes / (t * 1e-6) / 1e12:5.2f} TB/s  {tiles}")


def sweep(shape: str, batches) -> None:
    """Every tile and split for each projection and batch: the five fastest, and the heuristic's pick."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in SHAPES[shape].items():
        ws = weights(n, k, copies_needed(n, k))
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = fp8_kernels.quantize_rows(x, 128)
            bf16 = graph_time([lambda w=w: F.linear(x, w["bf16"]) for w in ws])
            results = []
            block_ms = (16, 32, 64, 128, 256) if m <= 256 else (64, 128)
            for bm, bn, split, warps, stages in itertools.product(block_ms, (32, 64, 128, 256), (1, 2, 4, 8, 16),
                                                                  (4, 8), (3, 5)):
                if bm < min(16, m) or (m <= 256 and bm > max(16, 2 * m)) or (m > 256 and split > 1):
                    continue
                if k // 128 // split < 2 or (bn == 256 and warps == 4) or (bn == 32 and warps == 8):
                    continue
                cfg = fp8_kernels.MatmulConfig(bm, bn, split, warps, stages)
                try:
                    t = graph_time([lambda v=v, s=s, cfg=cfg: fp8_kernels.scaled_matmul(xq, xs, v, s, None,
                                                                                        torch.bfloat16, cfg)
                                    for w in ws for v, s in [(w["values"], w["scales"])]], reps=3)
                except Exception as exc:  # out of shared memory or registers for this tile
                    print(f"  skip {cfg}: {type(exc).__name__}")
                    continue
                results.append((t, cfg))
            print_sweep(f"{name} m={m}: bf16 {bf16:.1f} us; heuristic", results,
                        fp8_kernels.matmul_config(m, n, k, num_sms), weight_bytes=n * k)
        del ws
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else BATCHES
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.sweep:
        sweep(args.shape, batches)
    else:
        compare(args.shape, batches)


if __name__ == "__main__":
    main()
