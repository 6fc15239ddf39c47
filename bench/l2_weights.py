"""What asking the L2 for a projection's weight saves, one projection at a time (``engine.ops.l2_prefetch``; sm_90).

    python bench/l2_weights.py --shape qwen3-0.6b
    python bench/l2_weights.py --shape llama-3.1-8b --batches 151

Each projection's pattern in a decode step: an RMSNorm kernel computes the product's input, then cuBLAS's product
reads it with the weight. Timed in CUDA graphs of several such pairs, each on its own copy of the weight (enough
copies that none is left in the 50 MB L2 by the pair before), microseconds per pair:

* ``product``: the products alone, cold;
* ``norm + product``: as the engine runs them today;
* ``norm prefetching + product``: the norm asking the L2 for the weight first (``MINIVLLM_L2_PREFETCH=1``);
* both again with programmatic dependent launch (``--pdl``), whose overlap the prefetch may use.

Weights larger than ``l2_prefetch.MAX_BYTES`` are not prefetched by the engine; they are shown for reference.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_gemm import L2_BYTES, SHAPES, graph_time  # noqa: E402

from engine.ops import fused as fused_ops  # noqa: E402
from engine.ops import (
    l2_prefetch,
    pdl,  # noqa: E402
)


def _settings(prefetch: bool, pdl_mode: str) -> None:
    os.environ["MINIVLLM_L2_PREFETCH"] = "1" if prefetch else "0"
    os.environ["MINIVLLM_PDL"] = pdl_mode
    l2_prefetch.reread_env()
    pdl.reread_env()


def measure(n: int, k: int, batch: int, pdl_modes: list[str]) -> dict[str, float]:
    dev = torch.device("cuda")
    weight_bytes = n * k * 2
    copies = max(4, -(-2 * L2_BYTES // weight_bytes))
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(batch, k, device=dev, dtype=torch.bfloat16)
    norm_weight = torch.ones(k, device=dev, dtype=torch.bfloat16)
    results = {"product": graph_time([lambda w=w: F.linear(x, w) for w in weights])}
    for mode in pdl_modes:
        for prefetch in (False, True):
            _settings(prefetch, mode)
            calls = [lambda w=w: F.linear(fused_ops.rms_norm(x, norm_weight, 1e-6, prefetch=w), w) for w in weights]
            label = ("norm prefetching + product" if prefetch else "norm + product") + (
                f", PDL {mode}" if mode != "off" else "")
            results[label] = graph_time(calls)
    _settings(False, "off")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 151, 256])
    parser.add_argument("--pdl", action="store_true", help="also with programmatic dependent launch (early)")
    args = parser.parse_args()
    if torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("bulk L2 prefetches need compute capability 9.0 or later")
    modes = ["off", "early"] if args.pdl else ["off"]
    print(f"{args.shape} on {torch.cuda.get_device_name()}: microseconds per pair, weights cold (copies > 2x L2)")
    for name, (n, k) in SHAPES[args.shape].items():
        size = n * k * 2
        note = "" if size <= l2_prefetch.MAX_BYTES else " (over MAX_BYTES: the engine does not prefetch it)"
        for batch in args.batches:
            res = measure(n, k, batch, modes)
            cells = ", ".join(f"{label} {us:.1f}" for label, us in res.items())
            print(f"  {name} {n} x {k} ({size / 2**20:.1f} MB){note}, batch {batch}: {cells}")


if __name__ == "__main__":
    main()
