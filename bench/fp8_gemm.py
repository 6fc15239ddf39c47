"""FP8 linear layers against bf16 ones at decode batch sizes, on Llama-3.1-8B's projections (the H200 numbers in
bench/RESULTS.md).

    python bench/fp8_gemm.py

For each projection (q|k|v, o, gate|up, down) and batch size: bf16 ``F.linear``; the FP8 path as the engine runs
it (activations quantized per token by the Triton kernel, then ``torch._scaled_mm`` with per-channel weight
scales); ``_scaled_mm`` alone on pre-quantized activations; and the Triton block-scaled kernel (128 x 128 weight
blocks). Prints microseconds and the weight bytes per second each reaches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import cuda_time  # noqa: E402

from engine.models import fp8, fp8_kernels  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BATCHES = (1, 16, 64, 128, 151, 256)


def timed(fn) -> float:
    return cuda_time(fn) * 1e6  # us


def main() -> None:
    torch.manual_seed(0)
    print(f"{'layer':>8} {'batch':>5} {'bf16':>9} {'fp8 path':>9} {'scaled_mm':>9} {'block':>9}  (us; weight TB/s)")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        values, scales = fp8.quantize_per_channel(w)
        block_values = values  # the same bytes with 128 x 128 block scales
        block_scales = torch.full((n // 128, k // 128), 1 / 64, device="cuda")
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = fp8_kernels.quantize_rows(x)
            xg, xgs = fp8_kernels.quantize_rows(x, 128)
            times = [
                timed(lambda: F.linear(x, w)),
                timed(lambda: fp8.fp8_linear(x, values, scales, None)),
                timed(lambda: torch._scaled_mm(xq, values.t(), scale_a=xs, scale_b=scales.view(1, -1),
                                               out_dtype=torch.bfloat16)),
                timed(lambda: fp8_kernels.block_scaled_matmul(xg, xgs, block_values, block_scales, (128, 128),
                                                              torch.bfloat16)),
            ]
            rates = [n * k * (2 if i == 0 else 1) / (t * 1e-6) / 1e12 for i, t in enumerate(times)]
            print(f"{name:>8} {m:>5} " + " ".join(f"{t:>6.1f}/{r:.1f}" for t, r in zip(times, rates)))


if __name__ == "__main__":
    main()
