"""Which path a module with a fused kernel runs: the torch reference, or the Triton kernel of ``engine.ops``.

``RMSNorm``, ``SiluAndMul``, ``RotaryEmbedding`` and ``FusedExperts`` each have both. The torch code is the
reference (the CPU tests compare it with transformers); the kernels round in the same order. Each module's
``use_triton`` picks one: ``None`` (the default) means Triton for CUDA tensors when triton is installed, torch
otherwise; True or False forces one (tests do, to compare the two).
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def runs_triton(setting: bool | None, x: torch.Tensor) -> bool:
    """A module's ``use_triton`` resolved for input ``x``: ``None`` means CUDA tensors (with triton installed)."""
    return (x.is_cuda and triton_installed()) if setting is None else setting


def fused_ops():
    """``engine.ops.fused``, imported on first use so that the torch path never needs triton."""
    from engine.ops import fused

    return fused
