"""Input checks that the fused ops' wrappers share, and room for their FP8 outputs."""

from __future__ import annotations

import torch

from engine.ops.triton_helpers import interpreted

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_activation(name: str, what: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name}: {what} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: {what} dtype {t.dtype} is not supported (one of {SUPPORTED_DTYPES})")
    if not (t.is_cuda or interpreted()):
        raise ValueError(f"{name}: {what} is on {t.device}: the kernels need CUDA tensors (or TRITON_INTERPRET=1)")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name}: {what} must be contiguous in its last dim, got strides {t.stride()}")


def _check_weight(name: str, what: str, w: torch.Tensor, size: int, like: torch.Tensor) -> None:
    if w.shape != (size,) or w.dtype != like.dtype or w.device != like.device or w.stride(0) != 1:
        raise ValueError(f"{name}: {what} must be a contiguous ({size},) {like.dtype} tensor on {like.device}, "
                         f"got {tuple(w.shape)} {w.dtype} on {w.device} with strides {w.stride()}")


def _check_column_scales(name: str, scales: torch.Tensor, width: int, like: torch.Tensor) -> None:
    if (scales.shape != (width,) or scales.dtype != torch.float32 or scales.device != like.device
            or scales.stride(0) != 1):
        raise ValueError(f"{name}: column_scales must be a contiguous ({width},) float32 tensor on {like.device}, "
                         f"got {tuple(scales.shape)} {scales.dtype} on {scales.device}")


def _fp8_output(name: str, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values, scales, group): room for ``x``'s rows of ``width`` columns quantized as cuBLAS's block-scaled
    product takes them (``fp8_kernels.empty_quantized``), after checking that the width splits into groups."""
    from engine.ops.fp8 import GROUP, empty_quantized

    if width % GROUP:
        raise ValueError(f"{name}: FP8 output needs a width that is a multiple of {GROUP}, got {width}")
    return (*empty_quantized(x.shape[0], width, GROUP, x.device, cublas_layout=True), GROUP)
