"""``Fp8LinearMethod``: float8_e4m3 weights with float32 scales; the arithmetic is ``engine.models.fp8``'s.

Two ways in, one layout in memory (``weight`` in FP8, ``weight_scale_inv`` the scales that multiply it back):

* ``--quantization fp8`` (``block`` None): W loads in the model dtype and ``process_after_loading`` quantizes it,
  one scale per output channel;
* an FP8 checkpoint (``block`` = its ``weight_block_size``, 128 x 128): W and one scale per tile load as stored.

What the kernels around the product may take over, decided once in ``process_after_loading``: on a GPU whose
cuBLAS multiplies with block scaling (``fp8.cublas_weight_scales``), the layer takes its input already quantized
by the kernel that computed it (``takes_fp8_input``: the add-norm, SwiGLU, decode attention write an
``Fp8Activation``), and from ``fp8.block_scales_min_rows`` tokens on ``apply_deferred`` leaves the per-channel
scales to the kernel that reads the product (``LinearOutput.column_scales``). On the CPU, which has no FP8
arithmetic, the weight is widened to float32 once (``widened_weight``) and the product computed from it, with the
activations rounded through FP8 as the GPU rounds them.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import max_over_ranks_
from engine.models import fp8
from engine.models.linear.method import LinearMethod, WeightLayout
from engine.models.linear.output import LinearOutput
from kvcache.paged_cache import FP8_DTYPE


class Fp8LinearMethod(LinearMethod):
    """``block``: an FP8 checkpoint's (rows, cols) of a weight scale's tile; None: quantize W after loading, one
    scale per output channel (a row-parallel rank's channels by their maximum over every rank's columns, so the
    weights round as on one GPU and the ranks' partial products share their scales)."""

    def __init__(self, block: tuple[int, int] | None = None):
        self.block = block

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        shape = (layer.out_features, layer.in_features)
        layer.widened_weight = None  # the CPU's float32 operand (process_after_loading)
        layer.cublas_scales = None  # the scales in cuBLAS's layouts, where it multiplies FP8 with block scaling
        if self.block is None:
            layer.add_param("weight", shape, dtype, WeightLayout())
            return
        bn, bk = self.block
        _check_block_alignment(layer, self.block)
        layer.add_param("weight", shape, FP8_DTYPE, WeightLayout())
        layer.add_param("weight_scale_inv", (-(-shape[0] // bn), -(-shape[1] // bk)), torch.float32,
                        WeightLayout(0, 1, bn, bk))

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.dtype != FP8_DTYPE:
            self._quantize_per_channel(layer)
        weight, scales = layer.weight, layer.weight_scale_inv
        out_features, in_features = layer.out_features, layer.in_features
        want = (out_features,) if self.block is None else (-(-out_features // self.block[0]),
                                                            -(-in_features // self.block[1]))
        if tuple(weight.shape) != (out_features, in_features) or tuple(scales.shape) != want:
            raise ValueError(f"an FP8 linear layer needs a {(out_features, in_features)} weight and {want} scales, "
                             f"has {tuple(weight.shape)} and {tuple(scales.shape)}")
        layer.widened_weight = fp8.widen_weight(weight, scales, self.block) if weight.device.type == "cpu" else None
        layer.cublas_scales = fp8.cublas_weight_scales(weight, scales, self.block)

    def _quantize_per_channel(self, layer: nn.Module) -> None:
        weight, amax = layer.weight.data, None
        if layer.input_shard is not None:  # this rank holds some of each channel's columns: the maximum of all
            amax = max_over_ranks_(weight.float().abs().amax(dim=1))
        values, scales = fp8.quantize_per_channel(weight, amax)
        layer.set_param("weight", values, WeightLayout())
        layer.set_param("weight_scale_inv", scales, WeightLayout(0, None))

    def takes_fp8_input(self, layer: nn.Module) -> bool:
        return layer.cublas_scales is not None

    def apply(self, layer: nn.Module, x, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8.fp8_linear(x, layer.weight, layer.weight_scale_inv, bias, self.block,
                              widened=layer.widened_weight, cublas_scales=layer.cublas_scales)

    def apply_deferred(self, layer: nn.Module, x, partials_ok: bool = True) -> LinearOutput:
        if layer.takes_fp8_input and layer.bias is None:  # a bias is added after the scales: not left over
            return LinearOutput(*fp8.fp8_linear_deferring_scales(x, layer.weight, layer.cublas_scales))
        return LinearOutput(self.apply(layer, x, layer.bias))


def _check_block_alignment(layer: nn.Module, block: tuple[int, int]) -> None:
    """Block scales can be split (tensor parallelism) or concatenated (q|k|v) only on tile boundaries."""
    bn, bk = block
    for shard, part in layer.parts.items():
        name = shard or "the weight"
        checks = []  # (what, a count of W's rows or columns, the tile it must be a multiple of)
        if part.rows is not None:
            checks.append((f"{name}'s rows", part.rows.stop - part.rows.start, bn))
        if part.source_rows is not None:
            checks.append((f"the first of {name}'s rows on this rank", part.source_rows[0], bn))
        if part.source_cols is not None:
            checks += [("the first of this rank's columns", part.source_cols[0], bk),
                       ("this rank's columns", part.source_cols[1], bk)]
        for what, count, tile in checks:
            if count % tile:
                raise ValueError(f"{what}: {count}, not a multiple of the FP8 weight block ({tile}); this split of "
                                 f"a block-quantized checkpoint is not supported")
