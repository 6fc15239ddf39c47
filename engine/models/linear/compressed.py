"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, as llm-compressor writes them): integer
weights with a scale per output channel or per group of input columns.

``pack-quantized`` (W4A16, W8A16): signed b-bit values v, stored as v + 2^(b - 1) packed along the input dim, the
first in a word's lowest bits; served by ``Int4CheckpointMethod`` (4 bits) or ``Int8CheckpointMethod`` (8 bits,
symmetric).

    weight_packed       [out, in * b / 32] int32
    weight_scale        [out, groups]  (strategy group) or [out, 1] (strategy channel)
    weight_zero_point   [out * b / 32, groups] int32, asymmetric only: signed zero points, offset as the values and
                        packed along the output dim
    weight_shape        [2]: the unpacked weight's [out, in]

W = (v - zp) * s, the same as (q - (zp + 2^(b - 1))) * s in the stored codes q. A symmetric checkpoint has no zero
points (zp = 0).

``int-quantized`` (W8A8, W8A16): ``weight`` [out, in] int8 as it is, ``weight_scale`` [out, 1] (or [out, groups]),
W = v * s. With int8 activations quantized per token at run time (W8A8) the layer is ``W8A8LinearMethod``'s
(``engine.models.linear.w8a8``); weight-only (W8A16) it is served as ``Int8CheckpointMethod`` through ``IntWeightLayout``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.linear.int_checkpoint import (
    CheckpointLayout,
    IntWeights,
    check_blocks,
    dummy_scale,
    random_words,
    repeated_word,
    unpack_words,
)
from engine.models.linear.method import WeightLayout


def _scale_layouts(layout: CheckpointLayout, layer: nn.Module, output_block: int) -> tuple[int, WeightLayout]:
    """(groups, the WeightLayout of a parameter [out / output_block, groups]) for ``layout``'s group size."""
    if layout.group_size is None:  # strategy channel: one column, not split along the input
        return 1, WeightLayout(0, None, output_block, 1)
    return layer.in_features // layout.group_size, WeightLayout(0, 1, output_block, layout.group_size)


class PackedLayout(CheckpointLayout):
    """``pack-quantized``: ``bits`` 4 or 8, ``group_size`` None for strategy channel, ``symmetric``: no zero
    points stored."""

    def __init__(self, bits: int, group_size: int | None, symmetric: bool):
        if bits not in (4, 8):
            raise ValueError(f"pack-quantized weights of {bits} bits are not supported (4 and 8 are)")
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric

    def describe(self) -> str:
        groups = f"groups of {self.group_size}" if self.group_size else "one scale per channel"
        return (f"compressed-tensors pack-quantized, int{self.bits} weights, {groups}, "
                f"{'symmetric' if self.symmetric else 'zero points'}")

    def create(self, layer: nn.Module) -> None:
        per_word = 32 // self.bits
        check_blocks(layer, per_word, max(per_word, self.group_size or 1), "compressed-tensors")
        out_features, in_features = layer.out_features, layer.in_features
        groups, scale_layout = _scale_layouts(self, layer, 1)
        layer.add_param("weight_packed", (out_features, in_features // per_word), torch.int32,
                        WeightLayout(0, 1, 1, per_word))
        layer.add_param("weight_scale", (out_features, groups), torch.float32, scale_layout)
        if not self.symmetric:
            layer.add_param("weight_zero_point", (out_features // per_word, groups), torch.int32,
                            _scale_layouts(self, layer, per_word)[1])
        layer.add_param("weight_shape", (2,), torch.int64, WeightLayout(None, None))

    def unpack(self, layer: nn.Module) -> IntWeights:
        codes = unpack_words(layer.weight_packed, self.bits)
        scales = layer.weight_scale.float()
        if self.symmetric:
            zero_points = torch.full_like(scales, float(1 << (self.bits - 1)))
        else:
            zero_points = unpack_words(layer.weight_zero_point.t(), self.bits).t().float()
        if layer.input_shard is None and int(layer.weight_shape[1]) != layer.in_features:
            raise ValueError(f"weight_shape says {int(layer.weight_shape[1])} input features, the layer has "
                             f"{layer.in_features}")
        return IntWeights(codes, zero_points, scales)

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        layer.weight_packed.copy_(random_words(tuple(layer.weight_packed.shape), generator, layer.weight_packed.device))
        layer.weight_scale.fill_(dummy_scale(self.bits))
        if not self.symmetric:
            layer.weight_zero_point.fill_(repeated_word(1 << (self.bits - 1), self.bits))  # zero points of 0
        layer.weight_shape.copy_(torch.tensor([layer.out_features, layer.in_features]))


class IntWeightLayout(CheckpointLayout):
    """``int-quantized`` weights served weight-only (W8A16): int8 values as they are, symmetric."""

    bits = 8

    def __init__(self, group_size: int | None):
        self.group_size = group_size

    def describe(self) -> str:
        groups = f"groups of {self.group_size}" if self.group_size else "one scale per channel"
        return f"compressed-tensors int-quantized, int8 weights, {groups}, activations in the compute dtype"

    def create(self, layer: nn.Module) -> None:
        check_blocks(layer, 1, self.group_size or 1, "compressed-tensors")
        groups, scale_layout = _scale_layouts(self, layer, 1)
        layer.add_param("weight", (layer.out_features, layer.in_features), torch.int8, WeightLayout())
        layer.add_param("weight_scale", (layer.out_features, groups), torch.float32, scale_layout)

    def unpack(self, layer: nn.Module) -> IntWeights:
        codes = (layer.weight.to(torch.int16) + 128).to(torch.uint8)
        scales = layer.weight_scale.float()
        return IntWeights(codes, torch.full_like(scales, 128.0), scales)

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        fill_int8_dummy(layer.weight, generator)
        layer.weight_scale.fill_(dummy_scale(8))


def fill_int8_dummy(weight: torch.Tensor, generator: torch.Generator) -> None:
    """Uniformly random int8 values (``dummy_scale(8)`` makes them N(0, 0.02)-sized)."""
    weight.copy_(torch.randint(-128, 128, tuple(weight.shape), dtype=torch.int8, generator=generator,
                               device=weight.device))
