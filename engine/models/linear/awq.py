"""AWQ checkpoints in AutoAWQ's GEMM layout (``quant_method: awq``, ``version: gemm``): 4-bit codes, served by
``Int4CheckpointMethod``.

    qweight  [in, out / 8] int32     8 output channels a word, in AWQ's order: the word's values 0-7 (lowest bits
                                     first) are channels 0, 2, 4, 6, 1, 3, 5, 7 of its 8
    qzeros   [in / group, out / 8] int32   the zero points, packed as qweight
    scales   [in / group, out]       float16

W[o, i] = (q[i, o] - zp[g, o]) * s[g, o] for i in group g (``zero_point: true``, AutoAWQ's default and the only kind
its GEMM layout writes). ``zero_point: false`` means symmetric codes: W = (q - 8) * s, and the checkpoint has no
qzeros. A group size of -1 is one group across the input. GEMV, GEMV-fast, Marlin and ExLlama layouts pack
otherwise and are refused where the config is read (``engine.loading.int_weights``).
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

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output channel j of a word's 8 is the word's value AWQ_ORDER[j]


def awq_channels(values: torch.Tensor) -> torch.Tensor:
    """Values unpacked from AWQ's words [..., n] (in the words' order) -> the same values in channel order."""
    return values.unflatten(-1, (-1, 8))[..., list(AWQ_ORDER)].flatten(-2)


class AwqLayout(CheckpointLayout):
    """``group_size``: None for one group across the input; ``zero_point``: whether the checkpoint has qzeros."""

    bits = 4

    def __init__(self, group_size: int | None, zero_point: bool = True):
        self.group_size, self.zero_point = group_size, zero_point

    def describe(self) -> str:
        groups = f"groups of {self.group_size}" if self.group_size else "one group per channel"
        return f"AWQ GEMM, int4, {groups}, {'zero points' if self.zero_point else 'symmetric'}"

    def create(self, layer: nn.Module) -> None:
        group = self.group_size or 1
        check_blocks(layer, 8, group, "AWQ")
        out_features, in_features = layer.out_features, layer.in_features
        groups = in_features // self.group_size if self.group_size else 1
        group_dim = 0 if self.group_size else None  # one group across the input is not split along it
        layer.add_param("qweight", (in_features, out_features // 8), torch.int32, WeightLayout(1, 0, 8, 1))
        if self.zero_point:
            layer.add_param("qzeros", (groups, out_features // 8), torch.int32, WeightLayout(1, group_dim, 8, group))
        layer.add_param("scales", (groups, out_features), torch.float32, WeightLayout(1, group_dim, 1, group))

    def unpack(self, layer: nn.Module) -> IntWeights:
        codes = awq_channels(unpack_words(layer.qweight, 4)).t()
        scales = layer.scales.t().float()
        if self.zero_point:
            zero_points = awq_channels(unpack_words(layer.qzeros, 4)).t().float()
        else:
            zero_points = torch.full_like(scales, 8.0)
        return IntWeights(codes, zero_points, scales)

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        layer.qweight.copy_(random_words(tuple(layer.qweight.shape), generator, layer.qweight.device))
        if self.zero_point:
            layer.qzeros.fill_(repeated_word(8, 4))
        layer.scales.fill_(dummy_scale(4))
