"""What several of the engine's Triton kernel modules share.

Device functions (``@triton.jit``, inlined where they are called), with the roundings of the torch code the kernels
reproduce (``engine.models`` (norm.py, rotary.py, activation.py), Hugging Face's order):

* ``round_to``: a float32 value rounded to a tensor's element type and back, as one torch op leaves it.
* ``norm_halves`` and ``rope_halves``: Qwen3's per-head RMSNorm and rope's rotate-half, on rows held as their two
  halves; the rope kernel (``engine.ops.fused.rope``) and the FP8 KV-cache write (``engine.ops.attention``) use both,
  so that the two round alike.
* ``store_fp8_groups``: columns of a row stored as float8_e4m3 with a scale per group (the norms' and SwiGLU's FP8
  outputs).

For the host: ``jit_without_specializing`` defines a kernel that compiles one variant whatever values some of its
arguments take from step to step; ``interpreted`` says whether the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl
from triton.runtime import JITFunction


@triton.jit
def round_to(x, out_ptr):
    """``x`` (float32) rounded to ``out_ptr``'s element type and back: one torch op's rounding."""
    return x.to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def norm_halves(x1, x2, w1, w2, eps, out_ptr, HEAD_DIM: tl.constexpr):
    """Qwen3's per-head RMSNorm of rows given as their two halves (float32, padding zeros): the norm in float32,
    cast to the model dtype (``out_ptr``'s), then times the weight's halves ``w1``/``w2`` and rounded again."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
    return round_to(w1 * round_to(x1 * rstd, out_ptr), out_ptr), round_to(w2 * round_to(x2 * rstd, out_ptr), out_ptr)


@triton.jit
def rope_halves(x1, x2, cos, sin, out_ptr):
    """Rotate-half of rows given as their two halves: ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``, float32, each
    product rounded to the model dtype (``out_ptr``'s) as torch rounds it; the caller rounds the sums."""
    o1 = round_to(x1 * cos, out_ptr) - round_to(x2 * sin, out_ptr)
    o2 = round_to(x2 * cos, out_ptr) + round_to(x1 * sin, out_ptr)
    return o1, o2


@triton.jit
def store_fp8_groups(v, cols, mask, q_row_ptr, s_row_ptr, stride_sg, first_group, num_groups):
    """``v`` [groups, group] float32, the columns ``cols`` of a row, one group per row of the tile, stored as
    float8_e4m3 with one float32 scale per group, the arithmetic of ``fp8_kernels.quantize_rows``: a group's
    absolute maximum maps to 448."""
    scale = tl.maximum(tl.max(tl.abs(v), 1) / 448.0, 1.1754943508222875e-38)
    tl.store(q_row_ptr + cols, (v / scale[:, None]).to(q_row_ptr.dtype.element_ty), mask=mask)
    groups = first_group + tl.arange(0, v.shape[0])
    tl.store(s_row_ptr + groups * stride_sg, scale, mask=groups < num_groups)


def jit_without_specializing(*names: str):
    """``triton.jit`` that compiles one variant whatever values these arguments take from step to step.

    Triton otherwise specializes ints on being 1 or a multiple of 16 and pointers on 16-byte alignment;
    a slice such as ``seq_lens[d:]`` is aligned or not depending on the number of decodes ``d``, so a
    running server would compile new variants mid-run. Only scalar loads go through these arguments.
    """
    kwargs = {"do_not_specialize": list(names)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = list(names)
    return triton.jit(**kwargs)


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they were defined: CPU tensors,
    for tests)."""
    return not isinstance(round_to, JITFunction)
