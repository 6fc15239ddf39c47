"""Decode attention on a bf16 and an FP8 KV cache, across tile shapes and register limits (the H200 numbers in
bench/RESULTS.md).

    python bench/fp8_attention_sweep.py [--groups 2 4]

A W1-like decode batch on the Qwen3-0.6B attention shape (8 KV heads, head_dim 128; 2 query heads per KV head,
4 for Llama-3.1-8B): 151 rows with contexts uniform in [200, 1400], one layer's cache; then 8 and 32 rows, whose
contexts get split. Each variant is timed as decode steps run it, 20 launches replayed from a CUDA graph, and
printed with the bytes per second it reads (K/V, and the FP8 scales). A variant is (BLOCK_N keys, warps, pipeline
stages, registers per thread at most); the one the engine picks is marked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import graph_time  # noqa: E402

from kvcache.paged_cache import quantize_fp8  # noqa: E402
from engine.attention.triton_kernels import _decode_tiles, choose_num_splits, num_sms, paged_decode_attention  # noqa: E402

VARIANTS = {
    "bf16": [(128, 4, 3, None), (128, 4, 3, 168), (128, 4, 3, 128), (64, 4, 3, None), (64, 4, 3, 128)],
    "fp8": [(128, 4, 3, None), (128, 4, 3, 168), (128, 4, 2, None), (128, 4, 2, 168), (128, 4, 3, 160),
            (128, 4, 2, 128), (64, 4, 3, None)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4], help="query heads per KV head")
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, head_dim, block = 151, 8, 128, 16
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
    fp8, scales = [], []
    for c in cache:
        values, s = quantize_fp8(c.flatten(0, 1))
        fp8.append(values.view(c.shape))
        scales.append(s.view(c.shape[:3]).contiguous())
    sms = num_sms(device)

    for group in args.groups:
        q = torch.randn(rows, kv_heads * group, head_dim, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q)
        for kind in ("bf16", "fp8"):
            k, v = (cache[0], cache[1]) if kind == "bf16" else (fp8[0], fp8[1])
            kv_scales = None if kind == "bf16" else tuple(scales)
            bytes_per_token = kv_heads * (2 * head_dim * (2 if kind == "bf16" else 1) + (0 if kind == "bf16" else 8))
            for n_rows in (rows, 8, 32):
                sub = slice(0, n_rows)
                tokens = int(lens[:n_rows].sum())
                splits = choose_num_splits(n_rows, kv_heads, max_blocks * block, sms)
                picked = _decode_tiles(head_dim, splits, kind == "fp8")
                for tiles in VARIANTS[kind] if n_rows == rows else [picked]:
                    try:
                        us = graph_time(lambda: paged_decode_attention(
                            q[sub], k, v, tables[sub], seq_lens[sub], 0.088, out[sub], splits,
                            order if n_rows == rows else None, tiles=tiles, kv_scales=kv_scales)) * 1e6
                    except Exception as error:  # e.g. a tile that does not fit the shared memory
                        print(f"group {group} {kind} {n_rows} rows {tiles}: {type(error).__name__}: {error}")
                        continue
                    mark = " (picked)" if tiles == picked else ""
                    print(f"group {group} {kind:4s} {n_rows:3d} rows, {splits:2d} splits, tiles {str(tiles):22s} "
                          f"{us:7.1f} us, {tokens * bytes_per_token / us / 1e6:.2f} TB/s{mark}", flush=True)


if __name__ == "__main__":
    main()
