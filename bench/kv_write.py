"""The KV-cache write on a bf16 and an FP8 cache: across tokens per program and with the queries rotated apart or
beside K, and with rope fused into it against the rope kernel followed by the write (the H200 numbers in
bench/RESULTS.md).

    python bench/kv_write.py [--kv-heads 8 --q-heads 16 --head-dim 128] [--qk-norm] [--column-scales]
    python bench/kv_write.py --kv-heads 8 --q-heads 32 --rope-only   # Llama-3.1-8B's heads, the rope comparison
    python bench/kv_write.py --rope-only --sweep-rope   # the fused FP8 launch across its tokens per program

One layer's write on Qwen3-0.6B's attention shape by default, for decode batches (32 to 256 tokens; W1's mean is
151), a chunk (2,048) and a long prefill step (16,384), into slots scattered over the cache. The FP8 write rotates
K and returns the queries rotated alike (``write_paged_kv(..., q=q)``), as the Triton backend calls it. Prints the
GPU time per call (calls replayed from a CUDA graph, as decode steps run); every FP8 variant is checked against
one token per program with the queries beside K (the same bytes, scales and rotated queries).

The rope table: q, k and v as views of one q|k|v tensor, as the models pass them; "pair" is the rope kernel
(``fused_ops.rotary``, ``qk_norm_rotary`` with ``--qk-norm``; the column-scale pass first with ``--column-scales``,
an FP8 q|k|v product's per-channel scales) followed by the write; "engine" is the write given the rope, as the
engine calls it (on a bf16 cache one launch that ropes as it writes; on an FP8 one the rope kernel, with the
column scales, then the write, up to ``_FP8_FUSED_ROPE_MAX_ROWS`` rows the fused launch); "fused" the FP8 write
kernel roping q and K itself (``_launch_write(..., fuse_rope=True)``). Each is checked against the pair (a bf16
cache bit for bit; FP8: V and its scales bit for bit, K and the queries to a rare rounding step where fused).
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

from engine.models.norm import RMSNorm  # noqa: E402
from engine.models.rotary import get_rope  # noqa: E402
from engine.ops import fused as fused_ops  # noqa: E402
from engine.ops.attention import write_paged_kv  # noqa: E402
from engine.ops.attention.kv_write import _launch_write  # noqa: E402
from engine.ops.attention.launch import _splits_queries, _write_tokens  # noqa: E402
from engine.ops.fp8 import scale_columns_  # noqa: E402
from kvcache.paged_cache import FP8_DTYPE  # noqa: E402


def tokens_per_program_sweep(args, rows: int, num_blocks: int, block: int, gen: torch.Generator) -> None:
    device = torch.device("cuda")
    shape = (num_blocks, block, args.kv_heads, args.head_dim)
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
            return _launch_write(k, v, fp8[0], fp8[1], slots, scales, q=q, tokens_per_program=tokens,
                                 split_queries=split)

        q_out = write()
        results[tokens, split] = (fp8[0].view(torch.uint8).clone(), fp8[1].view(torch.uint8).clone(),
                                  scales[0].clone(), scales[1].clone(), q_out)
        same = all(torch.equal(a, b) for a, b in zip(results[tokens, split], results[1, False]))
        us = graph_time(write) * 1e6
        chosen = " (chosen)" if tokens == _write_tokens(rows) and split == _splits_queries(rows) else ""
        print(f"{rows:>7} {'fp8':>6} {tokens:>11} {'apart' if split else 'with K':>8} {us:>9.1f}  "
              f"same as 1 with K: {same}{chosen}", flush=True)


def rope_comparison(args, rows: int, num_blocks: int, block: int, gen: torch.Generator) -> None:
    device = torch.device("cuda")
    heads, kv_heads, head_dim = args.q_heads, args.kv_heads, args.head_dim
    shape = (num_blocks, block, kv_heads, head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.randn(rows, width, device=device, dtype=torch.bfloat16, generator=gen)
    positions = torch.randint(0, 8192, (rows,), device=device, generator=gen)
    slots = torch.randperm(num_blocks * block - block, device=device, generator=gen)[:rows] + block
    column_scales = torch.rand(width, device=device, generator=gen) + 0.5 if args.column_scales else None
    with torch.device(device):
        rope = get_rope(head_dim, 8192, 5e5)
        norms = [RMSNorm(head_dim, 1e-6).bfloat16() for _ in range(2)] if args.qk_norm else []
    pending = rope.pending(*norms).at(positions, column_scales)
    scratch = torch.empty_like(qkv)

    def split(t):
        q, k, v = t.split(sizes, dim=-1)
        return q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim), v.view(rows, kv_heads, head_dim)

    for cache_dtype in (torch.bfloat16, FP8_DTYPE):
        fp8 = cache_dtype == FP8_DTYPE
        outputs = {}
        for name in ("pair", "engine", "fused") if fp8 else ("pair", "engine"):
            caches = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(2)]
            scales = tuple(torch.zeros(shape[:3], device=device) for _ in range(2)) if fp8 else None

            def pair():
                x = qkv
                if column_scales is not None:  # the product's own pass over q|k|v, in place as it runs
                    x = scale_columns_(scratch, column_scales)
                q, k, v = split(x)
                if norms:
                    q, k = fused_ops.qk_norm_rotary(positions, q, k, norms[0].weight, norms[1].weight, 1e-6,
                                                    rope.cos_sin_cache)
                else:
                    q, k = fused_ops.rotary(positions, q, k, rope.cos_sin_cache)
                return write_paged_kv(k, v, caches[0], caches[1], slots, scales, q=q)

            def with_rope(fuse_rope=None):
                q, k, v = split(qkv)
                return _launch_write(k, v, caches[0], caches[1], slots, scales, q=q, rope=pending,
                                     fuse_rope=fuse_rope)

            fn = {"pair": pair, "engine": with_rope, "fused": lambda: with_rope(True)}[name]
            scratch.copy_(qkv)  # the pair scales it again each call: only the first call's values are checked
            q_out = fn()
            outputs[name] = tuple(t.clone() for t in (q_out.float(), *(c.view(torch.uint8) if fp8 else c
                                                                       for c in caches), *(scales or ())))
            us = graph_time(fn) * 1e6
            print(f"{rows:>7} {'fp8' if fp8 else 'bf16':>6} {name:>6} {us:>9.1f}", end="", flush=True)
            if name != "pair":
                ref, got = outputs["pair"], outputs[name]
                exact = [torch.equal(a, b) for a, b in zip(got, ref)]
                close = torch.allclose(got[0], ref[0], rtol=2**-7, atol=1e-6)
                print(f"  bitwise q, K, V{', K scales, V scales' if fp8 else ''}: {exact}; q within a bf16 step: "
                      f"{close}", flush=True)
            else:
                print(flush=True)
        if fp8 and args.sweep_rope:  # the fused launch's choices (_write_tokens, _splits_queries: tuned without rope)
            caches = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(2)]
            scales = tuple(torch.zeros(shape[:3], device=device) for _ in range(2))
            q, k, v = split(qkv)
            for tokens, apart in itertools.product((1, 2, 4, 8, 16), (False, True)):
                us = graph_time(lambda: _launch_write(k, v, caches[0], caches[1], slots, scales, q=q, rope=pending,
                                                      tokens_per_program=tokens, split_queries=apart,
                                                      fuse_rope=True)) * 1e6
                chosen = " (chosen)" if tokens == _write_tokens(rows) and apart == _splits_queries(rows) else ""
                print(f"{rows:>7} {'fp8':>6} {'fused':>6} {us:>9.1f}  {tokens} a program, queries "
                      f"{'apart' if apart else 'with K'}{chosen}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 151, 256, 2048, 16384])
    parser.add_argument("--qk-norm", action="store_true", help="rope after Qwen3's per-head q/k norms")
    parser.add_argument("--column-scales", action="store_true",
                        help="q|k|v's per-channel FP8 weight scales applied first (FP8 prefill steps)")
    parser.add_argument("--rope-only", action="store_true", help="only the rope comparison, not the sweep")
    parser.add_argument("--sweep-rope", action="store_true",
                        help="the fused FP8 launch across tokens per program and queries apart or beside K")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    block = 16
    num_blocks = 2 * max(args.rows) // block + 1
    if not args.rope_only:
        print(f"{'tokens':>7} {'cache':>6} {'per program':>11} {'queries':>8} {'us':>9}")
        for rows in args.rows:
            tokens_per_program_sweep(args, rows, num_blocks, block, gen)
    print(f"\nrope{' after q/k norms' if args.qk_norm else ''}{' with column scales' if args.column_scales else ''}"
          f" and the write: {args.q_heads} query heads, {args.kv_heads} KV heads of {args.head_dim}")
    print(f"{'tokens':>7} {'cache':>6} {'launch':>6} {'us':>9}")
    for rows in args.rows:
        rope_comparison(args, rows, num_blocks, block, gen)


if __name__ == "__main__":
    main()
