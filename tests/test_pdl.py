"""Programmatic dependent launch (``engine.pdl``): where it is on, and what the kernels do with it.

The launches themselves need a Hopper GPU (``tests/test_gpu.py`` compares their tokens with plain launches);
here the kernels are compiled for sm_90 on the CPU and their PTX is read.
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

from engine import pdl

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("setting", ["on", "early"])
def test_cpu_tensors_launch_plainly_whatever_the_variable_says(monkeypatch, setting):
    monkeypatch.setenv("MINIVLLM_PDL", setting)
    assert pdl.mode_from_env() == pdl.MODES[setting]
    x = torch.zeros(4)
    assert pdl.mode(x) == 0
    assert pdl.launch_args(x) == {"PDL": 0}  # no launch attribute, which the interpreter would not take


def test_an_unknown_mode_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setenv("MINIVLLM_PDL", "yes")
    with pytest.raises(ValueError, match=r"MINIVLLM_PDL must be one of \['early', 'off', 'on'\], got 'yes'"):
        pdl.mode_from_env()
    monkeypatch.delenv("MINIVLLM_PDL")
    assert pdl.mode_from_env() == 0


# Compiled in a process of its own: the tests run Triton's interpreter, whose kernels do not compile.
_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.models.fused_ops import _silu_and_mul_kernel as kernel

mode = int(sys.argv[1])
constexprs = dict(COL_SCALES=False, FP8_GROUP=0, BLOCK=1024, ROWS=1, PDL=mode)
types = {"col_scale_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
signature = {n: types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in kernel.arg_names}
signature.update({n: "constexpr" for n in constexprs})
source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
options = dict(num_warps=4, **({"launch_pdl": True} if mode else {}))
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
print(json.dumps({"ptx": compiled.asm["ptx"], "launch_pdl": compiled.metadata.launch_pdl}))
"""


@pytest.mark.skipif(not pdl.triton_supports_pdl(), reason=f"Triton {triton.__version__} has no launch_pdl")
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_a_kernel_waits_for_the_one_before_ahead_of_its_first_memory_access(mode):
    """Compiled for sm_90: with PDL the SwiGLU kernel's first instruction that touches memory comes after
    ``griddepcontrol.wait`` (the kernel before may still write its input); "early" also lets the next kernel be
    dispatched; off, neither instruction is there and the launch carries no attribute."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(mode)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    lines = [line.strip() for line in result["ptx"].splitlines()]
    memory = [i for i, line in enumerate(lines) if ".global" in line and ("ld." in line or "st." in line)]
    waits = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
    assert memory, "the kernel reads and writes global memory"
    assert len(waits) == (1 if mode else 0)
    if mode:
        assert waits[0] < memory[0]
    assert sum(line.startswith("griddepcontrol.launch_dependents") for line in lines) == (1 if mode == 2 else 0)
    assert result["launch_pdl"] is bool(mode)
