"""``Int8LinearMethod``: 8-bit weights with a scale, and optionally a zero, per row and group of input columns
(GGUF's Q8_0, Q5_0, Q5_1, Q5_K and Q6_K blocks, and a fused layer whose parts are of different GGUF types).

W [out, in] is held as int8 codes q and, per row and group of ``group_size`` input columns, a scale s and, where
the method has them, a zero z:

    W[o, i] = q[o, i] * s[o, i // group_size]  (+ z[o, i // group_size])

    qweight  [out, in] int8          row-major: row o is output channel o, column i input feature i
    scales   [out, in / group]       the compute dtype; [out] with ``group_size`` None (one scale per row)
    zeros    [out, in / group]       the compute dtype, shaped as ``scales``; only with ``zeros=True``

This is the whole convention a kernel reading the parameters needs: the codes are plain signed bytes (no offset,
no packing), the scales and zeros plain tensors of the layer's compute dtype, and the group of column i is
i // group_size (GGUF gives 16 for Q6_K and a layer holding a Q6_K part, 32 otherwise). Without zeros W = q * s;
with them z is added after the scale (GGUF's Q5_1 is s = d, z = m; a K-quant's is s = d * scale, z = -dmin * min).
The WeightLayouts cut q|k|v parts and column-parallel shards by rows, and a row-parallel rank's columns in whole
groups (checked when the method is set).

``process_after_loading`` chooses the product once. torch's CPU op ``_weight_int8pack_mm`` (x [tokens, in] times
int8 W^T, then one scale per output channel) takes per-channel scales only (torch 2.14 has no CPU op for grouped
int8 weights: ``_weight_int8pack_mm`` wants 1-D scales, ``_int_mm`` quantized activations, the int4 ops 4-bit
codes): it is used on the CPU where a row has one scale and no zero (``group_size`` None, or a group as wide as
the layer), in bfloat16 (on x86 its float32 kernel is not vectorized, many times slower than a dense product) and
for input features a multiple of 64 (torch 2.14's bfloat16 kernel crashes where they are not a multiple of 16).
Group scales such as GGUF's cannot be folded into per-channel ones, so on the CPU those layers dequantize W once
into the compute dtype (``dequantized_weight``), multiply with ``F.linear`` and let their codes go (``qweight``
emptied: the layer takes the memory of an unquantized one, not that plus a byte a weight). On CUDA every layer runs the
Triton kernels of ``engine.ops.quant_matmul``, which read the codes with their group or row scales and zeros
(``engine.models.linear.quant_kernels``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.linear.int4 import DEQUANTIZE_ROWS, check_group_alignment, check_param
from engine.models.linear.method import LinearMethod, WeightLayout
from engine.models.linear.output import LinearOutput
from engine.models.linear.quant_kernels import cuda_kernels_apply, cuda_kernels_apply_deferred, cuda_quant_weight

INT8_CPU_DTYPES = (torch.bfloat16,)  # the dtypes it is used for: the one its x86 kernel vectorizes
INT8_CPU_IN_MULTIPLE = 64
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def int8_cpu_op_available() -> bool:
    """Whether this torch has the CPU int8 weight-only op (x times int8 W^T times per-channel scales)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """W = q * s (+ z) in the scales' dtype, computed in float32 a block of rows at a time; ``scales`` and
    ``zeros`` [out, groups] or [out]."""
    rows, in_features = qweight.shape
    scales = scales.reshape(rows, -1)
    zeros = None if zeros is None else zeros.reshape(rows, -1)
    weight = torch.empty(rows, in_features, dtype=scales.dtype, device=scales.device)
    for start in range(0, rows, DEQUANTIZE_ROWS):
        part = slice(start, start + DEQUANTIZE_ROWS)
        values = qweight[part].float().unflatten(1, (scales.shape[1], -1)).mul_(scales[part].float().unsqueeze(-1))
        if zeros is not None:
            values.add_(zeros[part].float().unsqueeze(-1))
        weight[part] = values.flatten(1)
    return weight


class Int8LinearMethod(LinearMethod):
    """``group_size``: the input columns that share a scale (and a zero): 32 for GGUF's Q8_0, Q5 and Q4_K blocks,
    16 for Q6_K's; None: one per row. ``zeros``: whether the layer has zero points (W = q * s + z)."""

    def __init__(self, group_size: int | None = 32, zeros: bool = False):
        if group_size is not None and group_size < 1:
            raise ValueError(f"an int8 group size must be positive, not {group_size}")
        self.group_size = group_size
        self.zeros = zeros

    def param_names(self) -> tuple[str, ...]:
        return ("qweight", "scales", "zeros") if self.zeros else ("qweight", "scales")

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.int8_channel_scales = None  # the CPU op's per-channel scales (process_after_loading)
        layer.dequantized_weight = None  # W in the compute dtype, where the op is not used
        layer.quant_weight = None  # what the CUDA kernels read (process_after_loading)
        shape = (layer.out_features, layer.in_features)
        layer.add_param("qweight", shape, torch.int8, WeightLayout())
        if self.group_size is None:
            group_shape, group_layout = shape[:1], WeightLayout(0, None)
        else:
            check_group_alignment(layer, self.group_size, "int8")
            group_shape, group_layout = (shape[0], shape[1] // self.group_size), WeightLayout(0, 1, 1, self.group_size)
        for name in self.param_names()[1:]:
            layer.add_param(name, group_shape, dtype, group_layout)

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        out_features, in_features, group_size = layer.out_features, layer.in_features, self.group_size
        if group_size is not None and in_features % group_size:
            raise ValueError(f"{in_features} input features do not divide into int8 groups of {group_size}")
        scales_shape = (out_features,) if group_size is None else (out_features, in_features // group_size)
        check_param(layer, "qweight", (out_features, in_features), (torch.int8,), "int8")
        check_param(layer, "scales", scales_shape, FLOAT_DTYPES, "int8")
        if self.zeros:
            check_param(layer, "zeros", scales_shape, (layer.scales.dtype,), "int8")
        layer.int8_channel_scales = layer.dequantized_weight = None
        layer.quant_weight = cuda_quant_weight(layer.qweight, layer.scales, layer.zeros if self.zeros else None, 8,
                                               group_size)
        if layer.quant_weight is not None:
            return
        if self.uses_cpu_op(layer):
            layer.int8_channel_scales = layer.scales.reshape(-1).contiguous()
        else:  # the copy is what multiplies: codes kept beside it would only add to its memory
            layer.dequantized_weight = dequantize_int8(layer.qweight, layer.scales,
                                                       layer.zeros if self.zeros else None)
            layer.qweight.data = layer.qweight.data.new_empty((0, 0))

    def uses_cpu_op(self, layer: nn.Module) -> bool:
        """Whether the layer's products go through torch's CPU int8 op (after loading, by its parameters)."""
        one_scale_a_row = self.group_size is None or self.group_size == layer.in_features
        return (layer.qweight.device.type == "cpu" and int8_cpu_op_available() and one_scale_a_row
                and not self.zeros and layer.scales.dtype in INT8_CPU_DTYPES
                and layer.in_features % INT8_CPU_IN_MULTIPLE == 0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.quant_weight is not None:
            return cuda_kernels_apply(layer.quant_weight, x, bias)
        if layer.int8_channel_scales is None:
            return F.linear(x, layer.dequantized_weight, bias)
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), layer.qweight,
                                                 layer.int8_channel_scales)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def apply_deferred(self, layer: nn.Module, x: torch.Tensor, partials_ok: bool = True) -> LinearOutput:
        if layer.quant_weight is not None:
            return cuda_kernels_apply_deferred(layer.quant_weight, x, layer.bias, partials_ok)
        return LinearOutput(self.apply(layer, x, layer.bias))
