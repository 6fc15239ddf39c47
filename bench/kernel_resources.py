"""What the attention kernels ask of an SM, compiled for a GPU that need not be present (sm_90 by default).

    python bench/kernel_resources.py [--arch 90] [--decode-tiles 128,4,2 64,4,3] [--prefill-tiles 64,64,4,3]

Compiles the decode kernel on a bf16 and on an FP8 cache and the prefill kernel (Qwen3-0.6B's heads: 2 query heads
a KV head, head_dim 128, blocks of 16) with Triton's own ptxas, with the specializations a launch gets (pointers
and strides 16-byte aligned, except the arguments the kernels keep unspecialized), and prints for each tile setting:
shared memory, registers a thread, the buffers Triton's pipeliner gave each K/V tile (``num_stages`` asks for
``num_stages - 1``, but a load whose address comes from a load of the same iteration gets fewer), and how many
programs one SM holds by shared memory, registers and warps (Hopper: 228 KB of shared memory, 1 KB of it reserved
per program, 65,536 registers, 64 warps). Needs no GPU; the engine's own choice for W1's decode steps is marked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.ops.attention.decode import _decode_split_kernel  # noqa: E402
from engine.ops.attention.decode_fp8 import _decode_split_fp8_kernel  # noqa: E402
from engine.ops.attention.launch import _decode_tiles, _prefill_tiles  # noqa: E402
from engine.ops.attention.prefill import _prefill_kernel  # noqa: E402

SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_PROGRAM = 1024
REGISTERS_PER_SM = 65536
WARPS_PER_SM = 64
PROGRAMS_PER_SM = 32

HEADS = dict(NUM_HEADS=16, GROUP=2, GROUP_PAD=16, HEAD_DIM=128, PAGE_SIZE=16)


def compile_kernel(fn, constexprs: dict, pointer_types: dict, arch: int, warps: int, stages: int):
    """``fn`` compiled for sm_``arch``: scalars named ``*_scale``/``softcap`` as float32, other scalars int32,
    pointers as ``pointer_types`` says (default ``*i32``); every pointer and int 16-divisible unless ``fn`` keeps it
    unspecialized or it is the block table's row stride (any table width)."""
    names = fn.arg_names
    plain = {names[a] if isinstance(a, int) else a for a in getattr(fn, "do_not_specialize", ())} | {"stride_bt"}
    signature, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name], consts[(i,)] = "constexpr", constexprs[name]
            continue
        if name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*i32")
        elif name in ("qk_scale", "softcap"):
            signature[name] = "fp32"
            continue
        else:
            signature[name] = "i32"
        if name not in plain:
            attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [n for n in names if n not in signature]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for {missing}")
    return triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def registers_per_thread(kernel) -> int:
    """From the cubin, with the cuobjdump Triton ships."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([str(tool), "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1))


def kv_buffers(ttgir: str, block_n: int) -> int:
    """The buffers of the key tiles: the leading size of the mutable shared allocations of ``block_n`` rows."""
    counts = [int(m.group(1)) for m in re.finditer(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x(\d+)x\d+x", ttgir)
              if int(m.group(2)) == block_n]
    return max(counts, default=0)


def programs_per_sm(shared: int, registers: int, warps: int) -> tuple[int, str]:
    """(programs one SM holds, what limits them)."""
    per_warp = -(-registers * 32 // 256) * 256  # registers are handed out 256 at a time, per warp
    limits = {
        "shared memory": SHARED_PER_SM // (shared + SHARED_RESERVED_PER_PROGRAM),
        "registers": REGISTERS_PER_SM // (per_warp * warps),
        "warps": WARPS_PER_SM // warps,
        "programs": PROGRAMS_PER_SM,
    }
    limit = min(limits, key=limits.get)
    return limits[limit], limit


def decode_row(tiles: tuple[int, int, int], fp8: bool, arch: int) -> dict:
    block_n, warps, stages = tiles
    consts = dict(HEADS, BLOCK_N=block_n, NUM_SPLITS=1, DOT_PRECISION="ieee", SLIDING=False, SOFTCAP=False)
    types = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    if fp8:
        consts.update(DOT_DTYPE=tl.float16, PTX=True, K_PAIRS=True, KV_HEADS=1, HEADS_FIRST=True)
        types.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
        fn = _decode_split_fp8_kernel
    else:
        types.update(k_cache_ptr="*bf16", v_cache_ptr="*bf16")
        fn = _decode_split_kernel
    kernel = compile_kernel(fn, consts, types, arch, warps, stages)
    return describe(kernel, ("decode FP8" if fp8 else "decode bf16"), tiles, warps, block_n)


def prefill_row(tiles: tuple[int, int, int, int], fp8: bool, arch: int) -> dict:
    block_m, block_n, warps, stages = tiles
    consts = dict(GROUP=HEADS["GROUP"], HEAD_DIM=HEADS["HEAD_DIM"], PAGE_SIZE=HEADS["PAGE_SIZE"], BLOCK_M=block_m,
                  BLOCK_Q=block_m // HEADS["GROUP"], BLOCK_N=block_n, DOT_PRECISION="ieee", SLIDING=False, FP8=fp8,
                  SOFTCAP=False, DOT_DTYPE=tl.float16 if fp8 else tl.bfloat16, HEADS_FIRST=True, SKIP_SINGLE=False)
    cache = "*fp8e4nv" if fp8 else "*bf16"
    types = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache,
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    kernel = compile_kernel(_prefill_kernel, consts, types, arch, warps, stages)
    return describe(kernel, "prefill FP8" if fp8 else "prefill bf16", tiles, warps, block_n)


def describe(kernel, name: str, tiles: tuple, warps: int, block_n: int) -> dict:
    shared, registers = kernel.metadata.shared, registers_per_thread(kernel)
    programs, limit = programs_per_sm(shared, registers, warps)
    return dict(kernel=name, tiles=tiles, shared=shared, registers=registers,
                buffers=kv_buffers(kernel.asm["ttgir"], block_n), programs_per_sm=programs, limited_by=limit)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    p.add_argument("--decode-tiles", nargs="*", default=["128,4,2", "128,4,3", "64,4,3", "64,4,4"],
                   help="BLOCK_N,warps,stages settings of the decode kernels")
    p.add_argument("--prefill-tiles", nargs="*", default=["64,64,4,3", "64,128,4,3"],
                   help="BLOCK_M,BLOCK_N,warps,stages settings of the prefill kernel")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = p.parse_args()
    rows = []
    for fp8 in (False, True):
        picked = _decode_tiles(HEADS["HEAD_DIM"], 1, fp8)
        for tiles in [tuple(int(x) for x in t.split(",")) for t in args.decode_tiles]:
            rows.append(dict(decode_row(tiles, fp8, args.arch), picked=tiles == picked))
    for fp8 in (False, True):
        picked = _prefill_tiles(1024, HEADS["GROUP"], HEADS["HEAD_DIM"], fp8)
        for tiles in [tuple(int(x) for x in t.split(",")) for t in args.prefill_tiles]:
            rows.append(dict(prefill_row(tiles, fp8, args.arch), picked=tiles == picked))
    if args.json:
        print(json.dumps(dict(arch=args.arch, triton=triton.__version__, rows=rows)))
        return 0
    print(f"sm_{args.arch}, Triton {triton.__version__}; Qwen3-0.6B's heads, unsplit decode contexts")
    print(f"{'kernel':>13} {'tiles':>16} {'shared KB':>9} {'regs':>5} {'K/V buffers':>11} {'programs an SM':>15}")
    for r in rows:
        tiles = "/".join(map(str, r["tiles"]))
        print(f"{r['kernel']:>13} {tiles:>16} {r['shared'] / 1024:9.1f} {r['registers']:5d} {r['buffers']:11d} "
              f"{r['programs_per_sm']:5d} ({r['limited_by']}){' (picked)' if r['picked'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
