"""GPTQ checkpoints (``quant_method: gptq``; AutoGPTQ's and GPTQModel's layout): 4-bit codes served by
``Int4CheckpointMethod``, symmetric 8-bit codes by ``Int8CheckpointMethod``.

    qweight  [in / p, out] int32         p = 32 / bits input rows a word, the first in the lowest bits
    qzeros   [groups, out / p] int32     the zero points, p output channels a word, likewise
    scales   [groups, out]               float16
    g_idx    [in] int32                  each input row's group

W[o, i] = (q[i, o] - zp[g_idx[i], o]) * s[g_idx[i], o]. ``checkpoint_format: gptq`` (v1, AutoGPTQ's, the default)
stores each zero point less one (zp = stored + 1: a stored 15 reads 16, as AutoGPTQ reads it); ``gptq_v2`` stores zp
itself. A symmetric checkpoint (``sym: true``) has zp = 2^(bits - 1) throughout. ``group_size: -1``: one group
across the input. Without ``desc_act`` g_idx is i // group_size; with it, the columns' groups are in the order the
quantizer visited them, and the columns are sorted by group when loaded (``int_checkpoint``).
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


class GptqLayout(CheckpointLayout):
    """``version``: 1 (zero points stored less one) or 2; ``desc_act``: the columns may be in act order."""

    g_idx = "g_idx"

    def __init__(self, bits: int, group_size: int | None, version: int = 1, desc_act: bool = False,
                 sym: bool = True):
        if bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoints of {bits} bits are not supported (4 and 8 are)")
        self.bits, self.group_size, self.version, self.desc_act, self.sym = bits, group_size, version, desc_act, sym

    def describe(self) -> str:
        groups = f"groups of {self.group_size}" if self.group_size else "one group per channel"
        return (f"GPTQ (checkpoint format v{self.version}), int{self.bits}, {groups}, "
                f"{'symmetric' if self.sym else 'zero points'}{', act order' if self.desc_act else ''}")

    def create(self, layer: nn.Module) -> None:
        per_word, group = 32 // self.bits, self.group_size or 1
        if self.desc_act and layer.input_shard is not None:
            raise ValueError("a GPTQ checkpoint with desc_act (act order) cannot split a layer's input columns over "
                             "tensor-parallel ranks: its groups are spread over all of them; serve it on one GPU")
        check_blocks(layer, per_word, max(per_word, group), "GPTQ")
        out_features, in_features = layer.out_features, layer.in_features
        groups = in_features // self.group_size if self.group_size else 1
        group_dim = 0 if self.group_size else None  # one group across the input is not split along it
        layer.add_param("qweight", (in_features // per_word, out_features), torch.int32,
                        WeightLayout(1, 0, 1, per_word))
        layer.add_param("qzeros", (groups, out_features // per_word), torch.int32,
                        WeightLayout(1, group_dim, per_word, group))
        layer.add_param("scales", (groups, out_features), torch.float32, WeightLayout(1, group_dim, 1, group))

    def unpack(self, layer: nn.Module) -> IntWeights:
        codes = unpack_words(layer.qweight.t(), self.bits)
        zero_points = unpack_words(layer.qzeros, self.bits).t().float()
        if self.version == 1:
            zero_points += 1
        return IntWeights(codes, zero_points, layer.scales.t().float(), layer.g_idx)

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        layer.qweight.copy_(random_words(tuple(layer.qweight.shape), generator, layer.qweight.device))
        middle = 1 << (self.bits - 1)
        layer.qzeros.fill_(repeated_word(middle - 1 if self.version == 1 else middle, self.bits))
        layer.scales.fill_(dummy_scale(self.bits))
