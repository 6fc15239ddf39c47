"""The greedy argmax of a decode step's logits: torch.argmax against ``engine.ops.greedy``'s two passes (needs a GPU).

    python bench/greedy_argmax.py [--rows 1,64,151,256] [--vocabs 151936,128256]

For each [rows, vocab] bfloat16 logits matrix: microseconds per call replayed from a CUDA graph, over logits copies
that together do not fit the L2 (as cold as a step's logits can be), the bandwidth that reading them once makes,
and the host time of one eager call (what the engine's launch of it costs, sampling being outside the decode graph).
Every variant's tokens are checked against torch.argmax's on random logits with ties planted. The copy bandwidth is
measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import cuda_time, graph_time  # noqa: E402

from engine.ops.greedy import _launch_greedy  # noqa: E402

VARIANTS = {"torch.argmax": None, **{f"2-pass {b}/{w}w": (b, w) for b in (2048, 4096, 8192) for w in (4, 8)}}


def copy_tbs() -> float:
    """Device-to-device copy bandwidth, bytes read and written, from plain calls: a copy captured in a graph
    becomes a memcpy node, which ran at two thirds of a kernel's rate on an H200."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / cuda_time(lambda: y.copy_(x), reps=10) / 1e12


def run(variant, logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1) if variant is None else _launch_greedy(logits, *variant)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,64,151,256")
    p.add_argument("--vocabs", default="151936,128256")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("greedy_argmax: needs a CUDA GPU", file=sys.stderr)
        return 2
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    tbs = copy_tbs()
    print(f"{torch.cuda.get_device_name()}: copy {tbs:.2f} TB/s, L2 {l2 / 2**20:.0f} MiB")
    ok = True
    for vocab in map(int, args.vocabs.split(",")):
        for rows in map(int, args.rows.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(rows)
            size = rows * vocab * 2
            copies = [torch.randn(rows, vocab, device="cuda", generator=gen).bfloat16()
                      for _ in range(max(2, -(-4 * l2 // size)))]
            check = copies[0].clone()
            check[:, vocab - 1] = check.max(dim=-1).values  # a tie at the last column: the first one wins
            check[0, :] = 0.0  # a row of one value: column 0
            want = check.argmax(dim=-1)
            line = [f"{vocab:>7} x {rows:<4}"]
            for name, variant in VARIANTS.items():
                same = torch.equal(run(variant, check), want)
                ok &= same
                turn = iter(range(1 << 30))
                us = graph_time(lambda: run(variant, copies[next(turn) % len(copies)]), calls=len(copies) * 4) * 1e6
                host = time.perf_counter()
                for _ in range(50):
                    run(variant, copies[0])
                host_us = (time.perf_counter() - host) / 50 * 1e6
                torch.cuda.synchronize()
                line.append(f"{name} {us:6.1f} us ({size / us / 1e6 / tbs:4.0%}, host {host_us:4.0f} us)"
                            + ("" if same else " MISMATCH"))
            print("  ".join(line[:2]) + "\n    " + "\n    ".join(line[2:]))
            del copies
    print("all variants gave torch.argmax's tokens" if ok else "MISMATCH: a variant gave other tokens")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
