"""The KV-write kernel on a bf16 and an FP8 cache, across tokens per program and with the queries rotated apart or
beside K (the H200 numbers in bench/RESULTS.md).

    python bench/kv_write.py [--kv-heads 8 --q-heads 16 --head-dim 128]

One layer's write on Qwen3-0.6B's attention shape by default, for decode batches (32 to 256 tokens; W1's mean is
151), a chunk (2,048) and a long prefill step (16,384), into slots scattered over the cache. The FP8 write rotates
K and returns the queries rotated alike (``write_paged_kv(..., q=q)``), as the Triton backend calls it. Prints the
GPU time per call (calls replayed from a CUDA graph, as decode steps run); every FP8 variant is checked against
one token per program with the queries beside K (the same bytes, scales and rotated queries).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import graph_time  # noqa: E402

from engine.attention.triton_kernels import _splits_queries, _write_tokens, write_paged_kv  # noqa: E402
from kvcache.paged_cache import FP8_DTYPE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 151, 256, 2048, 16384])
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    block = 16
    num_blocks = 2 * max(args.rows) // block + 1
    shape = (num_blocks, block, args.kv_heads, args.head_dim)
    print(f"{'tokens':>7} {'cache':>6} {'per program':>11} {'queries':>8} {'us':>9}")
    for rows in args.rows:
        k = torch.randn(rows, args.kv_heads, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        q = torch.randn(rows, args.q_heads, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
        slots = torch.randperm(num_blocks * block - block, device=device, generator=gen)[:rows] + block
        caches = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(2)]
        us = graph_time(lambda: write_paged_kv(k, v, caches[0], caches[1], slots)) * 1e6
        print(f"{rows:>7} {'bf16':>6} {'1':>11} {'':>8} {us:>9.1f}")
        results = {}
        for tokens, split in itertools.product((1, 2, 4, 8, 16), (False, True)):
            fp8 = [torch.zeros(shape, dtype=FP8_DTYPE, device=device) for _ in range(2)]
            scales = tuple(torch.zeros(shape[:3], device=device) for _ in range(2))

            def write():
                return write_paged_kv(k, v, fp8[0], fp8[1], slots, scales, q=q, tokens_per_program=tokens,
                                      split_queries=split)

            q_out = write()
            results[tokens, split] = (fp8[0].view(torch.uint8).clone(), fp8[1].view(torch.uint8).clone(),
                                      scales[0].clone(), scales[1].clone(), q_out)
            same = all(torch.equal(a, b) for a, b in zip(results[tokens, split], results[1, False]))
            us = graph_time(write) * 1e6
            chosen = " (chosen)" if tokens == _write_tokens(rows) and split == _splits_queries(rows) else ""
            print(f"{rows:>7} {'fp8':>6} {tokens:>11} {'apart' if split else 'with K':>8} {us:>9.1f}  "
                  f"same as 1 with K: {same}{chosen}", flush=True)

if __name__ == "__main__":
    main()
