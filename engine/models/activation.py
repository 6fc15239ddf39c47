"""``SiluAndMul``: SwiGLU on a fused [gate | up] projection (torch reference, or the Triton kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.fp8 import Fp8Activation
from engine.models.fused_path import fused_ops, runs_triton
from engine.models.linear.output import LinearOutput


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.use_triton: bool | None = None  # engine.models.fused_path

    def forward(self, x: torch.Tensor | LinearOutput, fp8_out: bool = False) -> torch.Tensor | Fp8Activation:
        """``x`` [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]. ``x`` may be gate|up's
        ``LinearOutput``, which the kernel finishes as it reads it (column scales applied, each product rounded to
        the model dtype before the activation; or partial products added first). ``fp8_out`` as in
        ``RMSNorm.forward``: the output quantized as the down projection takes it."""
        column_scales = None
        if isinstance(x, LinearOutput):
            if not runs_triton(self.use_triton, x.values):
                return self._forward_torch(x.finished())
            # [num_slices, num_tokens, 2 * intermediate] partial products: the kernel adds them up
            x, column_scales = (x.values, x.column_scales) if x.partials is None else (x.partials, None)
        elif not runs_triton(self.use_triton, x):
            return self._forward_torch(x)
        if fp8_out:
            values, scales = fused_ops().silu_and_mul_fp8(x, column_scales)
            return Fp8Activation(values, scales, x.shape[-2], x.dtype)
        return fused_ops().silu_and_mul(x, column_scales=column_scales)

    @staticmethod
    def _forward_torch(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
