"""Decode and prefill attention on a bf16 and an FP8 KV cache, across tile shapes and register limits (the H200
numbers in bench/RESULTS.md).

    python bench/fp8_attention_sweep.py [--groups 2 4] [--prefill]

A W1-like decode batch on the Qwen3-0.6B attention shape (8 KV heads, head_dim 128; 2 query heads per KV head, 4 for
Llama-3.1-8B): 151 rows with contexts uniform in [200, 1400] (``--contexts LO,HI`` for others), one layer's cache;
then the first 8 and 32 of them, whose contexts get split. Each batch is laid out longest context first, as the
model runner lays out decode rows. Each variant is timed as decode steps run it, 20 launches replayed
from a CUDA graph, and printed with the bytes per second it reads (K/V, and the FP8 scales). A variant is (BLOCK_N
keys, warps, pipeline stages, registers per thread at most); the one the engine picks is marked. ``--prefill`` times
the prefill kernel instead, on a W1-like prefill step: fresh prompts of uniform lengths in [100, 1024], 16,384
tokens in all, across (BLOCK_M rows, BLOCK_N keys, warps, stages).

    python bench/fp8_attention_sweep.py --baseline old_triton_kernels.py

times the FP8 decode kernel as the engine picks it against ``old_triton_kernels.py``, a module of its own that
has ``paged_decode_attention`` (e.g. engine/ops/attention/ of another commit gathered into one file; the single-file
engine/ops/attention.py of b5ef963 and earlier imports modules since removed, which it would need back),
alternating, in one process, and prints how far their outputs are apart; ``--baseline-cache bf16`` does the
same for the decode kernel on a bf16 cache.

    python bench/fp8_attention_sweep.py --fp8-out [--baseline old_triton_kernels.py]

times the decode kernels (bf16 and FP8 caches) writing their output quantized for an FP8 o_proj (``fp8_out``,
written by the merge of split contexts) against writing it plain and quantizing it with
``fp8_kernels.quantize_rows``, and against the baseline module's ``fp8_out`` where one is given (any split
count it takes); alternating, each twice.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import graph_time  # noqa: E402

from engine.ops.attention import choose_num_splits, num_sms  # noqa: E402
from engine.ops.attention.decode import _launch_decode  # noqa: E402
from engine.ops.attention.launch import _decode_kv_heads, _decode_tiles, _prefill_tiles  # noqa: E402
from engine.ops.attention.prefill import _launch_prefill  # noqa: E402
from kvcache.paged_cache import quantize_fp8  # noqa: E402

VARIANTS = {  # (BLOCK_N, warps, stages, registers a thread at most[, FP8: KV heads a program])
    "bf16": [(128, 4, 2, None), (128, 4, 3, None), (128, 4, 4, None), (128, 8, 3, None), (128, 8, 4, None),
             (64, 4, 2, None), (64, 4, 3, None), (64, 4, 4, None), (64, 8, 3, None), (256, 8, 2, None)],
    "fp8": [(128, 4, 2, None, 1), (128, 4, 3, None, 1), (128, 4, 4, None, 1), (128, 8, 3, None, 1),
            (64, 4, 3, None, 1), (64, 4, 4, None, 1), (128, 4, 3, None, 2), (128, 4, 2, None, 2)],
}


LAYOUT = "nhd"  # --layout: how the caches lie in memory
CONTEXTS = (200, 1400)  # --contexts: the decode batch's context lengths, uniform in [LO, HI)


def _laid_out(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., blocks, block, kv_heads, head_dim] as the kernels take it, stored as ``LAYOUT`` says: ``nhd`` as
    is, ``hnd`` with each KV head's keys of a block side by side (a [blocks, kv_heads, block, head_dim] tensor seen
    through a transpose)."""
    if LAYOUT == "nhd":
        return t
    stored = torch.empty(*t.shape[:-3], t.shape[-2], t.shape[-3], t.shape[-1], dtype=t.dtype, device=t.device)
    view = stored.transpose(-3, -2)
    view.copy_(t)
    return view


def paged_caches(lens: list[int], block: int, kv_heads: int, head_dim: int, gen: torch.Generator,
                 device: torch.device, max_blocks: int | None = None):
    """One layer's random bf16 K/V cache holding contexts of ``lens`` tokens in scattered blocks, the same quantized
    to FP8: (bf16 [2, blocks, block, kv_heads, head_dim], FP8 K and V, their scales, block tables on ``device``);
    K and V laid out as ``LAYOUT`` says (the scales stay [blocks, block, kv_heads])."""
    blocks = [-(-n // block) for n in lens]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(2, num_blocks, block, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(lens), max_blocks or max(blocks), dtype=torch.int32)
    at = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = ids[at:at + nb]
        at += nb
    fp8, scales = [], []
    for c in cache:
        values, s = quantize_fp8(c.flatten(0, 1))
        fp8.append(_laid_out(values.view(c.shape)))
        scales.append(s.view(c.shape[:3]).contiguous())
    return _laid_out(cache), fp8, scales, tables.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4], help="query heads per KV head")
    parser.add_argument("--layout", choices=("nhd", "hnd"), default="nhd",
                        help="caches as the engine keeps them (nhd: a block's tokens, each with its KV heads) or each "
                             "KV head's tokens of a block side by side (hnd)")
    parser.add_argument("--prefill", action="store_true", help="sweep the prefill kernel instead")
    parser.add_argument("--baseline", type=Path, help="a copy of triton_kernels.py to time the FP8 decode against")
    parser.add_argument("--fp8-out", action="store_true", help="time the decode kernels' quantized output")
    parser.add_argument("--baseline-cache", choices=("fp8", "bf16"), default="fp8",
                        help="the cache --baseline times the decode kernels on")
    parser.add_argument("--contexts", default="200,1400",
                        help="LO,HI: the decode batch's context lengths, uniform in [LO, HI)")
    args = parser.parse_args()
    global LAYOUT, CONTEXTS
    LAYOUT = args.layout
    try:
        CONTEXTS = tuple(int(x) for x in args.contexts.split(","))
    except ValueError:
        CONTEXTS = ()
    if len(CONTEXTS) != 2 or not 1 <= CONTEXTS[0] < CONTEXTS[1] <= 4096:
        parser.error(f"--contexts takes LO,HI with 1 <= LO < HI <= 4096, got {args.contexts!r}")
    if args.prefill:
        return prefill_sweep(args.groups)
    if args.fp8_out:
        return quantized_output(args.groups, args.baseline)
    if args.baseline:
        return against_baseline(args.groups, args.baseline, args.baseline_cache)
    device = torch.device("cuda")
    lens, cache, fp8, scales, tables, seq_lens, capacity = decode_batch(device)
    rows, kv_heads, head_dim = len(lens), cache.shape[3], cache.shape[4]
    sms = num_sms(device)

    for group in args.groups:
        q = torch.randn(rows, kv_heads * group, head_dim, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q)
        for kind in ("bf16", "fp8"):
            k, v = (cache[0], cache[1]) if kind == "bf16" else (fp8[0], fp8[1])
            kv_scales = None if kind == "bf16" else tuple(scales)
            bytes_per_token = kv_heads * (2 * head_dim * (2 if kind == "bf16" else 1) + (0 if kind == "bf16" else 8))
            for n_rows in (rows, 8, 32):
                qs, ts, ls = longest_first(n_rows, q, tables, seq_lens)
                tokens = sum(lens[:n_rows])
                splits = choose_num_splits(n_rows, kv_heads, capacity, sms)
                picked = (*_decode_tiles(head_dim, splits, kind == "fp8"), None)  # no register limit
                if kind == "fp8":
                    picked = (*picked, _decode_kv_heads(group, kv_heads, splits))
                for tiles in VARIANTS[kind] if n_rows == rows else [picked]:
                    try:
                        us = graph_time(lambda: _launch_decode(
                            qs, k, v, ts, ls, 0.088, out[:n_rows], splits, kv_scales=kv_scales, tiles=tiles)) * 1e6
                    except Exception as error:  # e.g. a tile that does not fit the shared memory
                        print(f"group {group} {kind} {n_rows} rows {tiles}: {type(error).__name__}: {error}")
                        continue
                    mark = " (picked)" if tiles == picked else ""
                    print(f"group {group} {kind:4s} {n_rows:3d} rows, {splits:2d} splits, tiles {str(tiles):22s} "
                          f"{us:7.1f} us, {tokens * bytes_per_token / us / 1e6:.2f} TB/s{mark}", flush=True)


def decode_batch(device: torch.device):
    """The W1-like decode batch, its rows in the order drawn: (context lengths, bf16 cache, FP8 K/V, scales, tables,
    seq_lens, table capacity in tokens). ``longest_first`` lays a batch out as the model runner does."""
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, head_dim, block = 151, 8, 128, 16
    lens = torch.randint(*CONTEXTS, (rows,), generator=gen).tolist()
    max_blocks = 4096 // block
    cache, fp8, scales, tables = paged_caches(lens, block, kv_heads, head_dim, gen, device, max_blocks)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return lens, cache, fp8, scales, tables, seq_lens, max_blocks * block


def longest_first(n_rows: int, q: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor):
    """The batch's first ``n_rows`` rows (queries, block tables, lengths) laid out longest context first, as the
    model runner lays out a step's decode rows: the kernels then take them in row order."""
    by_length = torch.argsort(seq_lens[:n_rows], descending=True, stable=True)
    return q[by_length].contiguous(), tables[by_length].contiguous(), seq_lens[by_length].contiguous()


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("baseline_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantized_output(groups: list[int], baseline_path: Path | None) -> None:
    """The decode kernels writing o_proj's quantized input against a plain output quantized afterwards."""
    from engine.ops import attention as current
    from engine.ops.fp8 import quantize_rows

    baseline = load_module(baseline_path) if baseline_path else None
    device = torch.device("cuda")
    lens, cache, fp8, scales, tables, seq_lens, capacity = decode_batch(device)
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    for group in groups:
        q = torch.randn(len(lens), kv_heads * group, head_dim, dtype=torch.bfloat16, device=device)
        for kind in ("bf16", "fp8"):
            k, v = (cache[0], cache[1]) if kind == "bf16" else (fp8[0], fp8[1])
            kv_scales = None if kind == "bf16" else tuple(scales)
            for n_rows in (len(lens), 8, 32):
                qs, ts, ls = longest_first(n_rows, q, tables, seq_lens)
                splits = choose_num_splits(n_rows, kv_heads, capacity, num_sms(device))
                out = torch.empty_like(qs)
                # As many rows as sequences: the engine's CUDA graphs take multiples of 4 and need no padding rows.
                quantized = (torch.empty(n_rows, out[0].numel(), dtype=torch.float8_e4m3fn, device=device),
                             torch.empty(out.shape[1], n_rows, dtype=torch.float32, device=device).t())

                def plain():
                    current.paged_decode_attention(qs, k, v, ts, ls, 0.088, out, splits, kv_scales=kv_scales)
                    quantize_rows(out.view(n_rows, -1), head_dim, cublas_layout=True)

                runs = {"plain + quantize_rows": plain}
                for name, module in (("fp8_out", current), ("baseline fp8_out", baseline)):
                    if module is not None and (splits > 1 or module is baseline):  # the merge writes fp8_out
                        runs[name] = lambda module=module: module.paged_decode_attention(
                            qs, k, v, ts, ls, 0.088, out, splits, kv_scales=kv_scales, fp8_out=quantized)
                for name, run in list(runs.items()) * 2:
                    print(f"group {group} {kind:4s} {n_rows:3d} rows, {splits:2d} splits, {name:22s} "
                          f"{graph_time(run) * 1e6:7.1f} us", flush=True)


def against_baseline(groups: list[int], path: Path, cache_kind: str = "fp8") -> None:
    """The decode kernel on an FP8 (or bf16) cache, the engine's tiles, against another version of the kernels'
    module, each timed twice, alternating, on the W1-like batch and on 8 and 32 rows with split contexts."""
    from engine.ops import attention as current

    baseline = load_module(path)
    device = torch.device("cuda")
    lens, cache, fp8, scales, tables, seq_lens, capacity = decode_batch(device)
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    kc, vc, ks = (cache[0], cache[1], None) if cache_kind == "bf16" else (fp8[0], fp8[1], tuple(scales))
    for group in groups:
        q = torch.randn(len(lens), kv_heads * group, head_dim, dtype=torch.bfloat16, device=device)
        for n_rows in (len(lens), 8, 32):
            qs, ts, ls = longest_first(n_rows, q, tables, seq_lens)
            splits = choose_num_splits(n_rows, kv_heads, capacity, num_sms(device))
            outs = {}
            for name, module in (("baseline", baseline), ("current", current)) * 2:
                out = torch.empty_like(qs)
                run = lambda: module.paged_decode_attention(qs, kc, vc, ts, ls, 0.088, out, splits,  # noqa: E731
                                                            kv_scales=ks)
                us = graph_time(run) * 1e6
                run()
                outs[name] = out.float()
                print(f"group {group} {n_rows:3d} rows, {splits:2d} splits, {name:8s} {us:7.1f} us", flush=True)
            print(f"    largest difference between the two: {(outs['current'] - outs['baseline']).abs().max():.4f}")


PREFILL_VARIANTS = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (64, 128, 4, 3), (128, 64, 8, 3),
                    (128, 128, 8, 2), (128, 64, 4, 2)]


def prefill_sweep(groups: list[int]) -> None:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    kv_heads, head_dim, block = 8, 128, 16
    lens = []
    while sum(lens) < 16384:
        lens.append(min(int(torch.randint(100, 1025, (1,), generator=gen)), 16384 - sum(lens)))
    cache, fp8, scales, tables = paged_caches(lens, block, kv_heads, head_dim, gen, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    starts = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    tokens = sum(lens)
    flops = sum(4 * n * (n + 1) / 2 * head_dim for n in lens)  # per query head: QK and PV over the causal half
    for group in groups:
        q = torch.randn(tokens, kv_heads * group, head_dim, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q)
        for kind in ("bf16", "fp8"):
            k, v = (cache[0], cache[1]) if kind == "bf16" else (fp8[0], fp8[1])
            kv_scales = None if kind == "bf16" else tuple(scales)
            picked = _prefill_tiles(max(lens), group, head_dim, kind == "fp8")
            for tiles in PREFILL_VARIANTS:
                try:
                    us = graph_time(lambda: _launch_prefill(
                        q, k, v, tables, starts, seq_lens, max(lens), 0.088, out, kv_scales=kv_scales,
                        tiles=tiles), calls=5) * 1e6
                except Exception as error:  # e.g. a tile that does not fit the shared memory
                    print(f"prefill group {group} {kind} {tiles}: {type(error).__name__}: {str(error)[:200]}")
                    continue
                mark = " (picked)" if tiles == picked else ""
                print(f"prefill group {group} {kind:4s} {len(lens)} prompts, {tokens} tokens, tiles {str(tiles):18s} "
                      f"{us:8.1f} us, {flops * kv_heads * group / us / 1e6:.0f} TFLOP/s{mark}", flush=True)


if __name__ == "__main__":
    main()
