"""Launch options of the engine's Triton kernels on Hopper: programmatic dependent launch (``engine.ops.pdl``) and weights
asked of the L2 cache (``engine.ops.l2_prefetch``). Both need an sm_90 GPU to run (``tests/test_gpu.py`` compares
their tokens with plain launches); here the kernels are compiled for sm_90 on the CPU and their PTX is read, and
the arithmetic that splits a weight among the programs runs in Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.ops import l2_prefetch, pdl

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("setting", ["on", "early"])
def test_cpu_tensors_launch_plainly_whatever_the_variables_say(monkeypatch, setting):
    monkeypatch.setenv("MINIVLLM_PDL", setting)
    monkeypatch.setenv("MINIVLLM_L2_PREFETCH", "1")
    assert pdl.mode_from_env() == pdl.MODES[setting] and l2_prefetch.enabled_from_env()
    x = torch.zeros(4, 8)
    assert pdl.mode(x) == 0
    assert pdl.launch_args(x) == {"PDL": 0}  # no launch attribute, which the interpreter would not take
    assert l2_prefetch.target(torch.zeros(64, 8), x, 4) is None


def test_unknown_settings_are_errors_naming_the_choices(monkeypatch):
    monkeypatch.setenv("MINIVLLM_PDL", "yes")
    with pytest.raises(ValueError, match=r"MINIVLLM_PDL must be one of \['early', 'off', 'on'\], got 'yes'"):
        pdl.mode_from_env()
    monkeypatch.setenv("MINIVLLM_L2_PREFETCH", "2")
    with pytest.raises(ValueError, match=r"MINIVLLM_L2_PREFETCH must be 0 or 1 \(or off, on\), got '2'"):
        l2_prefetch.enabled_from_env()
    monkeypatch.delenv("MINIVLLM_PDL")
    monkeypatch.delenv("MINIVLLM_L2_PREFETCH")
    assert pdl.mode_from_env() == 0 and not l2_prefetch.enabled_from_env()  # both off unless asked for


@triton.jit
def _share_ranges_kernel(out_ptr, num_bytes):
    start, end = l2_prefetch.share_range(num_bytes, tl.program_id(0), tl.num_programs(0))
    tl.store(out_ptr + 2 * tl.program_id(0), start)
    tl.store(out_ptr + 2 * tl.program_id(0) + 1, end)


@settings(max_examples=40, deadline=None)
@given(num_bytes=st.integers(0, 1 << 26).map(lambda n: n // 16 * 16), num_programs=st.integers(1, 300))
def test_the_programs_prefetch_every_byte_once_in_aligned_shares(num_bytes, num_programs):
    """However many programs a step launches, their shares are 16-byte aligned and cover the weight's bytes exactly
    once, in order: nothing read twice, nothing left out, nothing past the end."""
    ranges = torch.empty(num_programs, 2, dtype=torch.int64)
    _share_ranges_kernel[(num_programs,)](ranges, num_bytes)
    starts, ends = ranges[:, 0].tolist(), ranges[:, 1].tolist()
    assert starts[0] == 0 and ends[-1] == num_bytes
    assert all(s <= e for s, e in zip(starts, ends)) and starts[1:] == ends[:-1]
    assert all(s % 16 == 0 for s in starts)


# Compiled in a process of its own: the tests run Triton's interpreter, whose kernels do not compile.
_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module, name = sys.argv[1].split(":")
kernel = getattr(importlib.import_module(module), name)
constexprs, types, options = json.loads(sys.argv[2])
signature = {n: types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in kernel.arg_names}
signature.update({n: "constexpr" for n in constexprs})
source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, **options))
print(json.dumps({"ptx": compiled.asm["ptx"], "launch_pdl": compiled.metadata.launch_pdl}))
"""


def _sm90_ptx_lines(kernel: str, constexprs: dict, types: dict, options: dict) -> tuple[list[str], bool]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, kernel, json.dumps([constexprs, types, options])],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    return [line.strip() for line in result["ptx"].splitlines()], result["launch_pdl"]


def _first(lines: list[str], *prefixes: str) -> int | None:
    return next((i for i, line in enumerate(lines) if line.startswith(prefixes)), None)


def _first_memory_access(lines: list[str]) -> int:
    """The first plain load or store of global memory (predicated or not)."""
    return next(i for i, line in enumerate(lines) if ".global" in line and ("ld." in line or "st." in line)
                and "prefetch" not in line)


_NEEDS_PDL = pytest.mark.skipif(not pdl.triton_supports_pdl(), reason=f"Triton {triton.__version__}: no launch_pdl")


@_NEEDS_PDL
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_a_kernel_waits_for_the_one_before_ahead_of_its_first_memory_access(mode):
    """Compiled for sm_90: with PDL the SwiGLU kernel's first instruction that touches memory comes after
    ``griddepcontrol.wait`` (the kernel before may still write its input); "early" also lets the next kernel be
    dispatched; off, neither instruction is there and the launch carries no attribute."""
    lines, launch_pdl = _sm90_ptx_lines(
        "engine.ops.fused:_silu_and_mul_kernel",
        dict(COL_SCALES=False, FP8_GROUP=0, BLOCK=1024, ROWS=1, PDL=mode, PREFETCH=False, NUM_SLICES=1),
        {"col_scale_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "prefetch_ptr": "*u8"},
        {"launch_pdl": True} if mode else {})
    waits = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
    assert len(waits) == (1 if mode else 0)
    if mode:
        assert waits[0] < _first_memory_access(lines)
    assert sum(line.startswith("griddepcontrol.launch_dependents") for line in lines) == (1 if mode == 2 else 0)
    assert launch_pdl is bool(mode)


@_NEEDS_PDL
@pytest.mark.parametrize("prefetch", [False, True])
def test_the_norm_asks_for_the_next_weight_before_it_waits(prefetch):
    """Compiled for sm_90 with PDL: with ``PREFETCH`` the add-norm kernel issues its bulk L2 prefetches of the next
    product's weight before ``griddepcontrol.wait`` (the weight is never written, so it need not wait), and reads
    its own inputs only after it; without, no prefetch is there."""
    lines, _ = _sm90_ptx_lines(
        "engine.ops.fused:_rms_norm_kernel", dict(HAS_RESIDUAL=True, COL_SCALES=False, FP8_GROUP=0, BLOCK=1024, PDL=1,
                                 PREFETCH=prefetch, NUM_SLICES=1),
        {"col_scale_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "prefetch_ptr": "*u8", "eps": "fp32",
         "prefetch_bytes": "i64"}, {"launch_pdl": True})
    fetch = next((i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in line), None)
    wait = _first(lines, "griddepcontrol.wait")
    assert wait is not None and wait < _first_memory_access(lines)
    assert (fetch is not None) is prefetch
    if prefetch:
        assert fetch < wait


def test_decode_attention_asks_for_o_weight_after_its_output_is_stored():
    """Compiled for sm_90: decode attention's programs prefetch the output projection's weight at their end, after
    the last store of their output (the KV they read would evict lines fetched earlier)."""
    cons = dict(NUM_HEADS=16, GROUP=2, GROUP_PAD=16, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, NUM_SPLITS=1,
                DOT_PRECISION="tf32", SLIDING=False, SOFTCAP=False, PDL=0, PREFETCH=True)
    types = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
             "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "prefetch_ptr": "*u8",
             "qk_scale": "fp32", "softcap": "fp32", "prefetch_bytes": "i64"}
    lines, _ = _sm90_ptx_lines("engine.ops.attention:_decode_split_kernel", cons, types, {})
    fetches = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in line]
    stores = [i for i, line in enumerate(lines) if line.startswith(("st.global", "@")) and "st.global" in line]
    assert len(fetches) >= 1 and stores and min(fetches) > max(stores)
