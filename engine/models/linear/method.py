"""``LinearMethod``: how a linear layer holds its weight W and multiplies by it (vLLM's ``quant_method``).

A linear layer (``engine.models.linear.layer``) knows its shapes, its share of W under tensor parallelism and
which checkpoint tensors fill it; how W is stored and multiplied is its method's. The life of a layer:

    built        method.create_weights(layer, dtype)       the parameters, named as the checkpoint names them,
                                                           each with the WeightLayout that maps it onto W
    method set   layer.set_method(other)                   (before loading) the other method's parameters
    loaded       method.load_weight(layer, name, t, part)  one checkpoint tensor: all of W, a q|k|v part, a shard
    processed    method.process_after_loading(layer)       once: quantize, derive operands, check shapes
    run          method.apply(layer, x, bias)              every forward: x W^T + bias
                 method.apply_deferred(layer, x, ...)      the same, its last step left to the kernel that reads
                                                           it next (``LinearOutput``)

``UnquantizedLinearMethod`` (16/32-bit W; decode-sized products cut along K) and ``Fp8LinearMethod`` (FP8 W,
quantized at load time or loaded as an FP8 checkpoint stores it) are the methods the loader picks today, one per
layer (``set_linear_methods``); model files never name a method. ``Int4LinearMethod`` and ``Int8LinearMethod``
(grouped 4- and 8-bit codes with group scales, and zeros; GGUF's blocks convert to them in
``engine.loading.gguf_blocks`` and ``gguf_kquants``) follow the plan below; a GGUF model gets them for its file's
blocks (``engine.loading.gguf_weights``, with ``--quantization`` unset or ``gguf``), and an AWQ, GPTQ or
compressed-tensors checkpoint's ``quantization_config`` for its layers (``engine.loading.int_weights``:
``Int4CheckpointMethod`` and ``Int8CheckpointMethod`` load the checkpoint's tensors as stored and convert them once,
``engine.models.linear.int_checkpoint``).

**An int4 method** (AWQ, GPTQ, GGUF blocks) plugs in as another subclass. ``create_weights`` registers the packed
weight, its group scales and zero points, each with the WeightLayout that says how its dims map onto W: AWQ's
``qweight`` [in, out / 8] (int32, 8 values a word) is ``WeightLayout(output_dim=1, input_dim=0,
output_block=8)``, its ``scales`` [in / group, out] ``WeightLayout(output_dim=1, input_dim=0, input_block=group)``.
The default ``load_weight`` then cuts q|k|v parts and tensor-parallel shards out of them in those units (a
layout that interleaves rows, as some GGUF blocks do, overrides it). ``process_after_loading`` checks that the
groups do not straddle a shard and repacks for the kernel; ``apply`` calls the int4 GEMM; ``takes_fp8_input``
stays False (the GEMM reads x in the model dtype). The loader's method choice maps the checkpoint's
``quantization_config`` to it.

**LoRA adapters** (``engine.lora.layers``) wrap a layer's method once it is loaded: ``LoRALinearMethod(base)``
keeps the base method's parameters and product and adds each token's adapter product from the layer's slots of
stacked A and B (device buffers, not checkpoint parameters: the adapters come and go at run time). Its
``apply_deferred`` is the whole product and ``takes_fp8_input`` is False, since the adapter reads x whole. A
column-parallel layer holds every column of A and its rows of B, a row-parallel one its columns of A and all of B,
as it holds W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.linear.output import LinearOutput
from engine.models.weight_loading import copy_weight


@dataclass(frozen=True)
class WeightPart:
    """Which part of the layer's W one checkpoint tensor is, in W's rows and columns."""

    rows: slice | None = None  # the rows of W it fills (one projection of q|k|v or gate|up); None: all of them
    source_rows: tuple[int, int] | None = None  # (first, count): the tensor's rows this rank holds; None: all
    source_cols: tuple[int, int] | None = None  # (first, count): the tensor's columns this rank holds; None: all


@dataclass(frozen=True)
class WeightLayout:
    """How one parameter's dims map onto W [out_features, in_features]: index i of ``output_dim`` covers W's rows
    ``i * output_block`` to ``(i + 1) * output_block - 1`` (a tile of block scales; a word of packed values), and
    ``input_dim`` W's columns likewise. None: the parameter has no such dim (a per-channel scale or a bias has no
    input dim), and it is not split along it."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_block: int = 1
    input_block: int = 1

    def locate(self, param: torch.Tensor, tensor, part: WeightPart) -> tuple[torch.Tensor, torch.Tensor]:
        """(the view of ``param`` that checkpoint ``tensor`` fills, the part of ``tensor`` that fills it); only
        that part of a lazily read tensor is read."""
        dst, src = param, tensor
        if self.output_dim is not None:
            if part.rows is not None:
                rows = part.rows
                dst = dst.narrow(self.output_dim, *_in_blocks(rows.start, rows.stop - rows.start, self.output_block))
            if part.source_rows is not None:
                src = src.narrow(self.output_dim, *_in_blocks(*part.source_rows, self.output_block))
        if self.input_dim is not None and part.source_cols is not None:
            src = src.narrow(self.input_dim, *_in_blocks(*part.source_cols, self.input_block))
        return dst, src if isinstance(src, torch.Tensor) else src.load()


def _in_blocks(start: int, count: int, block: int) -> tuple[int, int]:
    """(first, count) of W's elements as (first, count) of the blocks that cover them."""
    return start // block, -(-count // block)


class LinearMethod:
    """The interface; see the module docstring. ``layer`` is the ``LinearBase`` the method serves: a method may
    serve many layers, and keeps everything per layer (parameters, derived operands) on the layer."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Register the layer's parameters with ``layer.add_param`` (the bias is the layer's own). ``dtype``: the
        model's compute dtype."""
        raise NotImplementedError

    def load_weight(self, layer: nn.Module, param_name: str, tensor, part: WeightPart, what: str) -> None:
        """Copy checkpoint ``tensor`` (named ``what``), or the part of it this rank holds, into parameter
        ``param_name`` where ``part`` says; by the parameter's WeightLayout unless a method knows better."""
        param = getattr(layer, param_name)
        copy_weight(*layer.param_layouts[param_name].locate(param.data, tensor, part), what)

    def process_after_loading(self, layer: nn.Module) -> None:
        """Once, after every tensor is loaded: quantize, derive what ``apply`` needs, check shapes and dtypes (so
        that ``apply`` checks nothing)."""

    def takes_fp8_input(self, layer: nn.Module) -> bool:
        """Whether ``apply`` takes an ``Fp8Activation``: its input quantized by the kernel that computed it (an
        add-norm, SwiGLU, decode attention). Asked once, after ``process_after_loading``."""
        return False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``: x [num_tokens, in_features] -> [num_tokens, out_features] in x's dtype."""
        raise NotImplementedError

    def apply_deferred(self, layer: nn.Module, x: torch.Tensor, partials_ok: bool = True) -> LinearOutput:
        """``apply`` with the layer's bias, as a ``LinearOutput`` whose last step (column scales, the sum of
        partial products) may be left to the kernel that reads it; ``partials_ok``: that reader adds partial
        products. By default nothing is left."""
        return LinearOutput(self.apply(layer, x, layer.bias))
