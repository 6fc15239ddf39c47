"""Check and time the Triton paged attention kernels on one GPU, in bfloat16.

    python bench/attention_kernels.py [--heads 16 --kv-heads 8 --head-dim 128 --block-size 16]

For each shape: relative error ||out - ref|| / ||ref|| against the torch backend run in float64
on the same (upcast) inputs, which must stay below 1e-2; then median times. Kernel and "graph"
times are device times (``do_bench_cudagraph``: launches replayed from a CUDA graph, so host
overhead drops out); "eager" times are ``do_bench`` on plain calls, host launch overhead included
where it dominates. Decode rows report the bandwidth achieved on the bytes that must move (K/V of
every context, q and out) next to a device-to-device copy measured in the same run; prefill rows
report TFLOP/s. A CUDA-graph check captures a decode step, changes the lengths in place, replays
it and compares; the host time of one eager backend call is measured too. Prints tables; writes
``$OUT/attention_kernels.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend, write_kv  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.ops.attention import (  # noqa: E402
    choose_num_splits,
    num_sms,
    paged_decode_attention,
    paged_prefill_attention,
)
from engine.ops.attention.decode import _launch_decode  # noqa: E402

MAX_REL_ERR = 1e-2


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_batch(reqs: list[tuple[int, int]], args, seed: int, dtype=torch.bfloat16) -> Batch:
    """Requests as (num_cached, query_len), decodes first; block ids shuffled over a cache that fits them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, bs = "cuda", args.block_size
    seq_lens = [c + n for c, n in reqs]
    query_lens = [n for _, n in reqs]
    nblocks = [triton.cdiv(s, bs) for s in seq_lens]
    num_blocks = 1 + sum(nblocks)
    shape = (num_blocks, bs, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=dev).to(torch.int32) + 1
    tables = torch.zeros(len(reqs), max(nblocks), dtype=torch.int32, device=dev)
    slots, used = [], 0
    for i, (s, n) in enumerate(zip(seq_lens, query_lens)):
        tables[i, : nblocks[i]] = perm[used : used + nblocks[i]]
        used += nblocks[i]
        pos = torch.arange(s - n, s, device=dev)
        slots.append(tables[i, pos // bs].long() * bs + pos % bs)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, args.heads, args.head_dim, generator=gen, device=dev, dtype=dtype)
    k = torch.randn(num_tokens, args.kv_heads, args.head_dim, generator=gen, device=dev, dtype=dtype)
    v = torch.randn(num_tokens, args.kv_heads, args.head_dim, generator=gen, device=dev, dtype=dtype)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    num_decodes = sum(1 for n in query_lens if n == 1)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), block_tables=tables,
        num_reqs=len(reqs), num_decodes=num_decodes, num_decode_tokens=num_decodes,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=bs,
        query_start_loc_cpu=qsl, seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return Batch(q, k, v, k_cache, v_cache, meta, 1.0 / math.sqrt(args.head_dim))


def layer_step(backend, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """One attention layer's step on ``backend`` as a function: the cache bound once, as ``Attention`` binds it."""
    layer = backend.bind(k_cache, v_cache, q.shape[1], scale)
    return lambda: backend.forward(layer, q, k, v, meta)


def reference(b: Batch) -> torch.Tensor:
    """The torch backend in float64 on the upcast inputs (its own copy of the cache)."""
    return layer_step(TorchAttentionBackend(), *[t.double() for t in (b.q, b.k, b.v, b.k_cache, b.v_cache)],
                      b.meta, b.scale)()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def bench_ms(fn) -> float:
    """Median eager time: host overhead shows where it exceeds the device time."""
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def device_ms(fn) -> float | None:
    """Median device time of fn replayed from a CUDA graph; None if fn cannot be captured."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    except Exception:  # e.g. a host sync inside fn
        torch.cuda.synchronize()
        return None


def kv_bytes(b: Batch) -> int:
    elem = b.k_cache.element_size()
    kv = int(b.meta.seq_lens_cpu.sum()) * b.k_cache.shape[2] * b.k_cache.shape[3] * 2 * elem
    return kv + 2 * b.q.numel() * elem


def attn_flops(b: Batch) -> float:
    """Multiply-adds of QK^T and PV over the causally visible keys, times 2."""
    lens, starts = b.meta.seq_lens_cpu.tolist(), b.meta.query_start_loc_cpu.tolist()
    pairs = 0
    for i, s in enumerate(lens):
        n = starts[i + 1] - starts[i]
        pairs += n * (s - n) + n * (n + 1) // 2
    return 4.0 * pairs * b.q.shape[1] * b.q.shape[2]


def run_decode_case(batch_size: int, ctx: int, args, copy_gbs: float) -> dict:
    gen = torch.Generator().manual_seed(batch_size * 7919 + ctx)
    lens = (ctx - torch.randint(0, args.block_size, (batch_size,), generator=gen)).tolist()  # end inside blocks
    b = make_batch([(s - 1, 1) for s in lens], args, seed=batch_size + ctx)
    m, d = b.meta, batch_size
    splits = choose_num_splits(d, args.kv_heads, m.block_tables.shape[1] * args.block_size, num_sms(b.q.device))
    out = torch.empty_like(b.q)
    decode = lambda n: paged_decode_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.seq_lens, b.scale, out, n)
    unified = lambda: paged_prefill_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.query_start_loc,
                                              m.seq_lens, 1, b.scale, out)
    ref, err = reference(b), 0.0
    for fn in (lambda: decode(splits), lambda: decode(1), unified):
        out.fill_(float("nan"))
        fn()
        err = max(err, rel_err(out, ref))
    del ref
    row = dict(kind="decode", batch=batch_size, ctx=ctx, splits=splits, rel_err=err,
               triton_ms=device_ms(lambda: decode(splits)), nosplit_ms=device_ms(lambda: decode(1)),
               unified_ms=device_ms(unified))
    row.update(_backend_times(b))
    row["gbs"] = kv_bytes(b) / row["triton_ms"] / 1e6
    row["pct_copy"] = 100.0 * row["gbs"] / copy_gbs
    return row


def run_mixed_decode_sweep(batch_size: int, args, copy_gbs: float) -> list[dict]:
    """A decode batch as W1 produces it: contexts uniform in ``--contexts`` ([100, 2048] by default). Rows in the
    order drawn vs laid out longest first (as the model runner lays them out), a few split counts, and a sweep of
    (BLOCK_N, num_warps, num_stages) tiles."""
    gen = torch.Generator().manual_seed(batch_size)
    lo, hi = args.contexts
    lens = torch.randint(lo, hi + 1, (batch_size,), generator=gen).tolist()
    batches = {ordered: make_batch([(s - 1, 1) for s in (sorted(lens, reverse=True) if ordered else lens)], args,
                                   seed=batch_size) for ordered in (False, True)}
    refs = {ordered: reference(b) for ordered, b in batches.items()}
    rows = []

    def measure(label: str, splits: int, ordered: bool, tiles=None) -> None:
        b, ref = batches[ordered], refs[ordered]
        m, out = b.meta, torch.empty_like(b.q)
        fn = lambda: _launch_decode(b.q, b.k_cache, b.v_cache, m.block_tables, m.seq_lens, b.scale, out, splits,
                                    tiles=tiles)
        out.fill_(float("nan"))
        try:
            fn()
        except Exception as e:  # e.g. tiles whose buffers need more shared memory than an SM has
            torch.cuda.synchronize()
            print(f"B={batch_size} {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            return
        ms = device_ms(fn)
        rows.append(dict(kind="decode-mixed", case=f"B={batch_size} {label}", batch=batch_size, splits=splits,
                         ordered=ordered, tiles=tiles, rel_err=rel_err(out, ref), triton_ms=ms,
                         context_mean=sum(lens) / len(lens), pct_copy=100.0 * kv_bytes(b) / ms / 1e6 / copy_gbs))

    for splits in (1, 2, 4):
        measure(f"in order, {splits} split(s)", splits, False)
        measure(f"longest first, {splits} split(s)", splits, True)
    for tiles in args.tiles:
        measure(f"longest first, tiles {tiles[0]}/{tiles[1]}w/{tiles[2]}s", 1, True, tiles)
    return rows


def run_prefill_case(name: str, reqs: list[tuple[int, int]], args) -> dict:
    b = make_batch(reqs, args, seed=len(reqs) + sum(n for _, n in reqs))
    m, d = b.meta, b.meta.num_decodes
    out = torch.empty_like(b.q)
    unified = lambda: paged_prefill_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.query_start_loc,
                                              m.seq_lens, m.max_query_len, b.scale, out)
    ref = reference(b)
    out.fill_(float("nan"))
    unified()
    err = rel_err(out, ref)
    err = max(err, rel_err(layer_step(TritonAttentionBackend(), b.q, b.k, b.v, b.k_cache, b.v_cache, m, b.scale)(),
                           ref))
    del ref
    row = dict(kind="prefill", case=name, batch=len(reqs), decodes=d, tokens=b.q.shape[0], rel_err=err,
               unified_ms=device_ms(unified))
    row.update(_backend_times(b))
    row["tflops"] = attn_flops(b) / row["unified_ms"] / 1e9
    return row


def _backend_times(b: Batch) -> dict:
    """A whole step (write_kv included) through each backend, replayed from a graph and eager."""
    times = {}
    for name, backend in (("backend", TritonAttentionBackend()), ("torch", TorchAttentionBackend())):
        step = layer_step(backend, b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale)
        times[f"{name}_ms"] = device_ms(step)
        times[f"{name}_eager_ms"] = bench_ms(step)
    return times


def check_cuda_graph(args) -> dict:
    """Capture a decode step, change lengths, slots and inputs in place (one row to padding), replay, compare."""
    b = make_batch([(2047 - 100 * i, 1) for i in range(16)], args, seed=5)
    m = b.meta
    step = layer_step(TritonAttentionBackend(), b.q, b.k, b.v, b.k_cache, b.v_cache, m, b.scale)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    new_lens = (m.seq_lens_cpu - torch.arange(16, dtype=torch.int32) * 37).clamp(min=1)
    new_lens[-1] = 0  # a padding row
    pos = (new_lens - 1).clamp(min=0).long()
    slots = m.block_tables.cpu()[torch.arange(16), pos // args.block_size].long() * args.block_size
    slots = slots + pos % args.block_size
    slots[-1] = 0  # the padding row's token goes to the null block
    m.seq_lens.copy_(new_lens)
    m.seq_lens_cpu.copy_(new_lens)
    m.slot_mapping.copy_(slots)
    for t in (b.q, b.k, b.v):
        t.normal_()
    graph.replay()
    got = out.clone()
    err = rel_err(got[:-1], reference(b)[:-1])
    padding_zero = bool((got[-1] == 0).all())
    calls = 200
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    host_us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return dict(kind="cuda_graph", rel_err=err, padding_row_zero=padding_zero, replay_ms=bench_ms(graph.replay),
                host_us_per_eager_call=host_us)


def copy_bandwidth_gbs() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def _us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.1f}"


def print_tables(copy_gbs: float, rows: list[dict], graph: dict) -> None:
    print(f"\ncopy bandwidth (read + write): {copy_gbs:.0f} GB/s. Times in us; kernel and graph: device time.")
    head = ("decode", "splits", "kernel", "GB/s", "%copy", "1-split", "unified", "step", "eager", "torch",
            "t.eager", "x torch", "rel err")
    print("\n" + " ".join(f"{h:>8}" for h in head).replace(f"{'decode':>8}", f"{'decode':>14}"))
    for r in (r for r in rows if r["kind"] == "decode"):
        cells = (r["splits"], _us(r["triton_ms"]), f"{r['gbs']:.0f}", f"{r['pct_copy']:.0f}%", _us(r["nosplit_ms"]),
                 _us(r["unified_ms"]), _us(r["backend_ms"]), _us(r["backend_eager_ms"]), _us(r["torch_ms"]),
                 _us(r["torch_eager_ms"]), _ratio(r["torch_ms"], r["backend_ms"]), f"{r['rel_err']:.1e}")
        print(f"{'B=%d ctx=%d' % (r['batch'], r['ctx']):>14} " + " ".join(f"{c:>8}" for c in cells))
    head = ("tokens", "kernel", "TFLOP/s", "step", "eager", "torch", "t.eager", "x torch", "rel err")
    print(f"\n{'prefill':>28} " + " ".join(f"{h:>8}" for h in head))
    for r in (r for r in rows if r["kind"] == "prefill"):
        cells = (r["tokens"], _us(r["unified_ms"]), f"{r['tflops']:.1f}", _us(r["backend_ms"]),
                 _us(r["backend_eager_ms"]), _us(r["torch_ms"]), _us(r["torch_eager_ms"]),
                 _ratio(r["torch_ms"], r["backend_ms"]), f"{r['rel_err']:.1e}")
        print(f"{r['case']:>28} " + " ".join(f"{c:>8}" for c in cells))
    print(f"\ncuda graph decode B=16: rel err {graph['rel_err']:.1e}, padding row zero {graph['padding_row_zero']}, "
          f"eager replay {_us(graph['replay_ms'])} us; host time of one eager backend call "
          f"{graph['host_us_per_eager_call']:.1f} us")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16)  # Qwen3-0.6B
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mixed-sweep", action="store_true",
                   help="only the mixed-length decode batches: row order, splits and tile sizes")
    p.add_argument("--mixed-batches", default="160,256", help="--mixed-sweep: rows of each batch")
    p.add_argument("--contexts", default="100,2048", help="--mixed-sweep: the contexts' range (uniform)")
    p.add_argument("--tiles", help="--mixed-sweep: BLOCK_N,warps,stages settings, space-separated")
    args = p.parse_args()
    args.contexts = tuple(int(x) for x in args.contexts.split(","))
    args.tiles = ([tuple(int(x) for x in t.split(",")) for t in args.tiles.split()] if args.tiles else
                  [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)])
    if not torch.cuda.is_available():
        print("attention_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    if args.mixed_sweep:
        batches = [int(x) for x in args.mixed_batches.split(",")]
        rows = [r for bsz in batches for r in run_mixed_decode_sweep(bsz, args, copy_gbs)]
        print(f"copy bandwidth {copy_gbs:.0f} GB/s")
        for r in rows:
            print(f"{r['case']:>48}: {r['triton_ms'] * 1e3:8.1f} us  {r['pct_copy']:5.1f}% of copy  "
                  f"rel err {r['rel_err']:.1e}")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "attention_mixed_sweep.json"), "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows), f, indent=1)
        return 0 if all(r["rel_err"] < MAX_REL_ERR for r in rows) else 1
    rows = [run_decode_case(bsz, ctx, args, copy_gbs) for bsz in (1, 16, 64, 256) for ctx in (512, 1024, 4096)]
    prefill_cases = {
        "1 x 4096 fresh": [(0, 4096)],
        "4 x 1024 fresh": [(0, 1024)] * 4,
        "8 x 512 after 1024 cached": [(1024, 512)] * 8,
        "2 x 1024 chunk after 3072": [(3072, 1024)] * 2,
        "64 dec@1024 + 2 x 512": [(1023, 1)] * 64 + [(512, 512)] * 2,
        "256 dec@2048 + 1 x 256": [(2047, 1)] * 256 + [(0, 256)],
    }
    rows += [run_prefill_case(name, reqs, args) for name, reqs in prefill_cases.items()]
    graph = check_cuda_graph(args)
    print_tables(copy_gbs, rows, graph)
    failures = [r for r in rows + [graph] if not r["rel_err"] < MAX_REL_ERR] + \
        ([graph] if not graph["padding_row_zero"] else [])
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "attention_kernels.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, shape=vars(args),
                           rows=rows, cuda_graph=graph, ok=not failures), f, indent=1)
    if failures:
        print(f"\nFAILED: {len(failures)} case(s) above the relative error bound {MAX_REL_ERR}", file=sys.stderr)
        return 1
    print(f"\nall cases within relative error {MAX_REL_ERR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
