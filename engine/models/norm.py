"""``RMSNorm``: root-mean-square norm over the last dim, optionally fused with the residual add.

The torch code follows Hugging Face's Llama/Qwen step by step (including where it casts between float32 and the
model dtype), so our logits match theirs in float32 and bfloat16 alike; the Triton kernels of ``engine.ops.fused``
round in the same order (``engine.models.fused_path`` picks the path).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.fp8 import Fp8Activation
from engine.models.fused_path import fused_ops, runs_triton
from engine.models.linear.output import LinearOutput, sum_partials


class RMSNorm(nn.Module):
    """``forward(x)`` returns the normed ``x``. ``forward(x, residual)`` first forms ``x + residual`` and returns
    ``(normed, x + residual)``: the sum is the residual stream the next layer adds to."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton: bool | None = None  # engine.models.fused_path

    def forward(
        self, x: torch.Tensor | LinearOutput, residual: torch.Tensor | None = None, fp8_out: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` [..., hidden], or a linear layer's ``LinearOutput`` [num_tokens, hidden] (o's or down's), which the
        add-norm kernel finishes as it reads it: column scales applied, each product rounded to the model dtype
        before the add, or partial products added first. ``fp8_out``: the next linear layer takes an
        ``Fp8Activation`` (``LinearBase.takes_fp8_input``); the Triton path then returns one, quantized as that
        layer would quantize the normed rows, in the same kernel. The torch path returns the normed rows either
        way."""
        if isinstance(x, LinearOutput):
            if not runs_triton(self.use_triton, x.values):
                return self._forward_torch(x.finished(), residual)
            return self._forward_fused(x.values, residual, fp8_out, x.column_scales, x.partials)
        if not runs_triton(self.use_triton, x):
            return self._forward_torch(x, residual)
        return self._forward_fused(x, residual, fp8_out)

    def _forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, fp8_out: bool,
                       column_scales: torch.Tensor | None = None, partials: torch.Tensor | None = None):
        if partials is not None:
            if residual is not None and not fp8_out:  # the add-norm kernel adds the slices as it reads them
                return fused_ops().fused_add_rms_norm(partials, residual, self.weight, self.eps)
            x = sum_partials(partials)
        if fp8_out and x.dim() == 2:
            values, scales, residual = fused_ops().rms_norm_fp8(x, self.weight, self.eps, residual, column_scales)
            out = Fp8Activation(values, scales, x.shape[0], x.dtype)
            return out if residual is None else (out, residual)
        return self._forward_triton(x, residual, column_scales)

    def _forward_torch(self, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is not None:
            # Add in the model dtype, as Hugging Face does, so the stored residual is exactly theirs.
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before scaling by the weight: the same rounding order as Hugging Face.
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)

    def _forward_triton(self, x: torch.Tensor, residual: torch.Tensor | None, column_scales: torch.Tensor | None):
        rows = x.reshape(-1, x.shape[-1])  # the kernels take [num_tokens, hidden]; a view for 2-D input
        if residual is None:
            if column_scales is not None:
                raise ValueError("RMSNorm: column_scales come with a residual (the add they are fused into)")
            return fused_ops().rms_norm(rows, self.weight, self.eps).view(x.shape)
        out, residual = fused_ops().fused_add_rms_norm(rows, residual.reshape(rows.shape), self.weight, self.eps,
                                                       column_scales)
        return out.view(x.shape), residual.view(x.shape)
