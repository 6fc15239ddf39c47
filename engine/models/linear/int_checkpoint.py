"""Integer checkpoints (AWQ, GPTQ, compressed-tensors) served by the int4 and int8 methods.

Such a checkpoint holds each quantized linear layer's W as unsigned b-bit codes q packed into int32 words, with a
scale s and an integer zero point zp per row and group of input columns: W = (q - zp) * s. Which dim the words run
along, the order of the values within a word and how the zero points are stored differ per format (a
``CheckpointLayout`` each: ``awq.py``, ``gptq.py``, ``compressed.py``); what they hold maps exactly onto the methods'
own layouts:

* 4 bits: ``Int4LinearMethod``'s codes are the same q and its zero is z = (8 - zp) * s (W = (q - 8) * s + z);
* 8 bits, symmetric (zp = 128 throughout): ``Int8LinearMethod``'s codes are q - 128 and its scales s.

``Int4CheckpointMethod`` and ``Int8CheckpointMethod`` register the layout's parameters under the checkpoint's names
and in its shapes, each with the WeightLayout that maps it onto W, so that the default ``load_weight`` cuts q|k|v parts
and tensor-parallel shards out of them. ``process_after_loading`` then unpacks them once, puts the int4 or int8
method's parameters in their place (the checkpoint's are dropped: memory is not held twice) and runs that method's own
processing; its ``apply`` serves the products.

Act order (GPTQ's ``desc_act``): the columns were quantized in another order, and ``g_idx`` [in] gives each input
column's group. The columns are sorted by group once (a stable sort, W's columns permuted with it), so that every
group is contiguous as the methods hold them, and ``apply`` permutes x's columns the same way. The parts of a fused
layer (q|k|v, gate|up) share their input and so one order: each part's ``g_idx`` is kept and they must agree. A
row-parallel rank whose columns are not in group order would need groups that other ranks hold: refused.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.linear.int4 import Int4LinearMethod, pack_int4, unpack_int4
from engine.models.linear.int8 import Int8LinearMethod
from engine.models.linear.method import WeightLayout, WeightPart
from engine.models.linear.output import LinearOutput
from engine.models.weight_loading import copy_weight, take

DUMMY_STD = 0.02  # random weights' standard deviation, as the loader's dummy weights


@dataclass
class IntWeights:
    """What a checkpoint layout holds for one layer, unpacked: W = (codes - zero_points) * scales, per group."""

    codes: torch.Tensor  # [out, in] uint8: unsigned codes
    zero_points: torch.Tensor  # [out, groups] float32: the code of 0, an integer
    scales: torch.Tensor  # [out, groups] float32
    g_idx: torch.Tensor | None = None  # [parts, in]: each input column's group, per part; None: groups in order


class CheckpointLayout:
    """How one format stores a layer's codes, scales and zero points. ``bits``: 4 or 8; ``group_size``: the input
    columns that share a scale (None: one group across the whole input, per output channel); ``g_idx``: the name of
    the per-column group parameter, if the format has one. A layout serves many layers and keeps nothing per layer."""

    bits: int = 4
    group_size: int | None = None
    g_idx: str | None = None

    def describe(self) -> str:
        """For the start-up log, e.g. "AWQ GEMM, int4, groups of 128, zero points"."""
        raise NotImplementedError

    def create(self, layer: nn.Module) -> None:
        """Register the checkpoint's parameters on ``layer`` (``layer.add_param``)."""
        raise NotImplementedError

    def unpack(self, layer: nn.Module) -> IntWeights:
        """The loaded parameters as codes, zero points and scales (and ``g_idx`` rows where the format has them)."""
        raise NotImplementedError

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random codes, and scales and zero points that make W about N(0, ``DUMMY_STD``) (``--load-format dummy``)."""
        raise NotImplementedError

    def method_group(self, layer: nn.Module) -> int:
        """The group size of the int4 or int8 method serving ``layer``: the format's, or this rank's input columns
        where one group spans the whole input."""
        return self.group_size or layer.in_features


# ------------------------------------------------------------------------------------------ packed words


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., n] -> codes [..., n * 32 / bits] uint8: value j of a word in its bits j * bits on (the
    first value in the lowest bits), in that order. (Read through the words' bytes: a little-endian host's.)"""
    as_bytes = words.contiguous().view(torch.uint8)
    return as_bytes if bits == 8 else unpack_int4(as_bytes)


def random_words(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """int32 words of uniformly random bits (so uniformly random codes of any width)."""
    count = 4 * torch.Size(shape).numel()
    values = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator, device=device)
    return values.view(torch.int32).view(shape)


def repeated_word(code: int, bits: int) -> int:
    """The int32 word all of whose values are ``code``."""
    word = 0
    for shift in range(0, 32, bits):
        word |= code << shift
    return word - (1 << 32) if word >= 1 << 31 else word


def dummy_scale(bits: int) -> float:
    """A scale that gives uniformly random codes (minus the middle one) a standard deviation of ``DUMMY_STD``."""
    levels = 1 << bits
    return DUMMY_STD / ((levels * levels - 1) / 12) ** 0.5


def check_blocks(layer: nn.Module, output_block: int, input_block: int, kind: str) -> None:
    """Packed words and groups can be cut into parts (q|k|v rows) and tensor-parallel shards only whole: each part's
    rows and this rank's first row and column must fall on ``output_block`` rows and ``input_block`` columns."""
    if layer.in_features % input_block or layer.out_features % output_block:
        raise ValueError(f"a [{layer.out_features}, {layer.in_features}] weight does not cut into the {kind} "
                         f"checkpoint's blocks of {output_block} rows and {input_block} columns")
    for shard, part in layer.parts.items():
        name = shard or "the weight"
        checks = []  # (what, a count of W's rows or columns, the block it must be a multiple of)
        if part.rows is not None:
            checks += [(f"{name}'s first row", part.rows.start, output_block),
                       (f"{name}'s rows", part.rows.stop - part.rows.start, output_block)]
        if part.source_rows is not None:
            checks.append((f"the first of {name}'s rows on this rank", part.source_rows[0], output_block))
        if part.source_cols is not None:
            checks.append(("the first of this rank's columns", part.source_cols[0], input_block))
        for what, count, block in checks:
            if count % block:
                raise ValueError(f"{what}: {count}, not a multiple of {block}; this split of a {kind} checkpoint's "
                                 f"packed values and groups is not supported")


def replace_params(layer: nn.Module, params: dict[str, tuple[torch.Tensor, WeightLayout]]) -> None:
    """Drop the method's parameters (the bias stays) and register ``params`` in their place."""
    for name in [name for name in layer.param_layouts if name != "bias"]:
        del layer.param_layouts[name]
        delattr(layer, name)
    for name, (tensor, layout) in params.items():
        layer.set_param(name, tensor, layout)


# ------------------------------------------------------------------------------------------ the methods


class _CheckpointParams:
    """What the int4 and int8 checkpoint methods share: the checkpoint's parameters registered in place of the
    method's own, ``g_idx`` kept per part, the columns sorted by group, x permuted to match."""

    layout: CheckpointLayout

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        super().create_weights(layer, dtype)  # the method's per-layer state and group checks
        replace_params(layer, {})
        layer.compute_dtype = dtype  # the converted scales and zeros are held in the compute dtype
        layer.input_perm = None  # act order: the input columns sorted by group (process_after_loading)
        self.layout.create(layer)
        if self.layout.g_idx is not None:
            layer.add_param(self.layout.g_idx, (len(layer.parts), layer.in_features), torch.int32,
                            WeightLayout(None, 1))

    def load_weight(self, layer: nn.Module, param_name: str, tensor, part: WeightPart, what: str) -> None:
        if param_name != self.layout.g_idx:
            super().load_weight(layer, param_name, tensor, part, what)
            return
        index = next(i for i, p in enumerate(layer.parts.values()) if p is part)  # one row per part
        copy_weight(getattr(layer, param_name).data[index], take(tensor, 0, part.source_cols), what)

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        self.layout.fill_dummy(layer, generator)
        if self.layout.g_idx is not None:  # groups in order
            g_idx = getattr(layer, self.layout.g_idx)
            g_idx.copy_(self._groups_in_order(layer, g_idx.device).expand(len(layer.parts), -1))

    def unpacked(self, layer: nn.Module) -> IntWeights:
        """The layout's codes, zero points and scales, the columns sorted by group (``layer.input_perm``)."""
        if sys.byteorder != "little":
            raise ValueError("integer checkpoints are read through their words' bytes, on little-endian hosts only")
        weights = self.layout.unpack(layer)
        groups = layer.in_features // (self.group_size or layer.in_features)
        if (tuple(weights.codes.shape) != (layer.out_features, layer.in_features)
                or tuple(weights.zero_points.shape) != (layer.out_features, groups)
                or tuple(weights.scales.shape) != (layer.out_features, groups)):
            raise ValueError(f"the checkpoint's codes {tuple(weights.codes.shape)}, zero points "
                             f"{tuple(weights.zero_points.shape)} and scales {tuple(weights.scales.shape)} do not make "
                             f"a [{layer.out_features}, {layer.in_features}] weight")
        layer.input_perm = perm = self._group_order(layer, weights.g_idx)
        if perm is not None:
            weights.codes = weights.codes.index_select(1, perm)
        return weights

    def _group_order(self, layer: nn.Module, g_idx: torch.Tensor | None) -> torch.Tensor | None:
        """None where the input columns are in group order already, else the permutation that sorts them."""
        if g_idx is None:
            return None
        g_idx = g_idx.long()
        if (g_idx != g_idx[:1]).any():
            raise ValueError(f"the parts of this fused layer ({', '.join(map(str, layer.parts))}) order their input "
                             f"columns differently (act order); one layer's input can be permuted one way only")
        g_idx, in_order = g_idx[0], self._groups_in_order(layer, g_idx.device)
        if torch.equal(g_idx, in_order):
            return None
        if layer.input_shard is not None:
            raise ValueError("act-order groups (desc_act) spread over the tensor-parallel ranks: this rank's input "
                             "columns need groups another rank holds; serve this checkpoint on one GPU")
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], in_order):
            raise ValueError(f"g_idx does not give each group {self.layout.group_size} input columns")
        return perm

    def _groups_in_order(self, layer: nn.Module, device: torch.device) -> torch.Tensor:
        """Each of this rank's input columns' group where the groups are in order (the checkpoint's numbering)."""
        start = layer.input_shard[0] if layer.input_shard is not None else 0
        columns = torch.arange(start, start + layer.in_features, device=device)
        return columns // self.layout.group_size if self.layout.group_size else torch.zeros_like(columns)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        return super().apply(layer, x, bias)

    def apply_deferred(self, layer: nn.Module, x: torch.Tensor, partials_ok: bool = True) -> LinearOutput:
        if layer.input_perm is not None:
            return LinearOutput(self.apply(layer, x, layer.bias))
        return super().apply_deferred(layer, x, partials_ok)


class Int4CheckpointMethod(_CheckpointParams, Int4LinearMethod):
    """A 4-bit checkpoint's layer: loaded in ``layout``'s tensors, served as ``Int4LinearMethod`` with groups of
    ``group_size`` (``layout.method_group(layer)``)."""

    def __init__(self, layout: CheckpointLayout, group_size: int, float32_in_bfloat16: bool = False):
        if layout.bits != 4:
            raise ValueError(f"Int4CheckpointMethod serves 4-bit layouts, not {layout.bits}-bit")
        super().__init__(group_size, float32_in_bfloat16)
        self.layout = layout

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        weights = self.unpacked(layer)
        dtype = layer.compute_dtype
        zeros = (8 - weights.zero_points) * weights.scales  # exact in float32: zp is a small integer
        replace_params(layer, {"qweight": (pack_int4(weights.codes), WeightLayout(0, 1, 1, 2)),
                               "scales": (weights.scales.to(dtype), WeightLayout(0, 1, 1, self.group_size)),
                               "zeros": (zeros.to(dtype), WeightLayout(0, 1, 1, self.group_size))})
        super().process_after_loading(layer)


class Int8CheckpointMethod(_CheckpointParams, Int8LinearMethod):
    """An 8-bit symmetric checkpoint's layer: loaded in ``layout``'s tensors, served as ``Int8LinearMethod`` (one
    scale per row where ``group_size`` is None)."""

    def __init__(self, layout: CheckpointLayout, group_size: int | None):
        if layout.bits != 8:
            raise ValueError(f"Int8CheckpointMethod serves 8-bit layouts, not {layout.bits}-bit")
        super().__init__(group_size)
        self.layout = layout

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        weights = self.unpacked(layer)
        if not bool((weights.zero_points == 128).all()):
            raise ValueError("8-bit weights with zero points other than 128 (asymmetric) are not supported: the "
                             "int8 method has no zero points")
        codes = (weights.codes.to(torch.int16) - 128).to(torch.int8)
        scales = weights.scales.to(layer.compute_dtype)
        if self.group_size is None:
            replace_params(layer, {"qweight": (codes, WeightLayout()), "scales": (scales[:, 0], WeightLayout(0, None))})
        else:
            replace_params(layer, {"qweight": (codes, WeightLayout()),
                                   "scales": (scales, WeightLayout(0, 1, 1, self.group_size))})
        super().process_after_loading(layer)
