"""Decode attention on a bf16 and an FP8 KV cache, across tile shapes (the H200 numbers in bench/RESULTS.md).

    python bench/fp8_attention_sweep.py

A W1-like decode batch on the Qwen3-0.6B attention shape (8 KV heads, 16 query heads, head_dim 128):
151 rows with contexts uniform in [200, 1400], one layer's cache. Prints each kernel time and the bytes
per second it reads (K/V, and the FP8 scales).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import cuda_time  # noqa: E402

from kvcache.paged_cache import quantize_fp8  # noqa: E402
from engine.attention.triton_kernels import choose_num_splits, num_sms, paged_decode_attention  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, group, head_dim, block = 151, 8, 2, 128, 16
    lens = torch.randint(200, 1400, (rows,), generator=gen)
    max_blocks = 4096 // block
    num_blocks = int(sum(-(-int(n) // block) for n in lens)) + 1
    cache = torch.randn(2, num_blocks, block, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens.tolist()):
        nb = -(-n // block)
        tables[i, :nb] = ids[at:at + nb]
        at += nb
    tables, seq_lens = tables.to(device), lens.to(torch.int32).to(device)
    order = torch.argsort(seq_lens, descending=True).to(torch.int32)
    q = torch.randn(rows, kv_heads * group, head_dim, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    fp8 = []
    scales = []
    for c in cache:
        values, s = quantize_fp8(c.flatten(0, 1))
        fp8.append(values.view(c.shape))
        scales.append(s.view(c.shape[:3]).contiguous())
    splits = choose_num_splits(rows, kv_heads, max_blocks * block, num_sms(device))
    tokens = int(lens.sum())

    def timed(fn) -> float:
        return cuda_time(fn) * 1e6  # us

    for kind in ("bf16", "fp8"):
        k, v = (cache[0], cache[1]) if kind == "bf16" else (fp8[0], fp8[1])
        kv_scales = None if kind == "bf16" else tuple(scales)
        bytes_per_token = 2 * kv_heads * head_dim * (2 if kind == "bf16" else 1) + (0 if kind == "bf16" else 8 * kv_heads)
        for small_rows in (8, 32):
            sub = slice(0, small_rows)
            n = choose_num_splits(small_rows, kv_heads, max_blocks * block, num_sms(device))
            for block_n in (64, 128):
                us = timed(lambda: paged_decode_attention(
                    q[sub], k, v, tables[sub], seq_lens[sub], 0.088, out[sub], n, None,
                    tiles=(block_n, 4, 3), kv_scales=kv_scales))
                print(f"{kind} {small_rows} rows, {n} splits, BLOCK_N={block_n}: {us:7.1f} us")
        for block_n, warps, stages in itertools.product((64, 128), (4, 8), (2, 3)):
            try:
                us = timed(lambda: paged_decode_attention(q, k, v, tables, seq_lens, 0.088, out, splits, order,
                                                          tiles=(block_n, warps, stages), kv_scales=kv_scales))
            except Exception as error:  # a tile that does not fit the shared memory
                print(f"{kind} BLOCK_N={block_n} warps={warps} stages={stages}: {type(error).__name__}")
                continue
            print(f"{kind} BLOCK_N={block_n:3d} warps={warps} stages={stages}: {us:7.1f} us, "
                  f"{tokens * bytes_per_token / us / 1e6:.2f} TB/s")


if __name__ == "__main__":
    main()
