"""``UnquantizedLinearMethod``: W in the model dtype (bfloat16 on the GPU, float32 on the CPU), ``F.linear``.

At decode sizes (up to ``DECODE_KSPLIT_MAX_ROWS`` tokens) a product of few tokens has few output tiles, far fewer
programs than the GPU has SMs, each running the whole of K. With ``k_slices`` > 1 (``MINIVLLM_DECODE_KSPLIT``,
``engine.models.linear.ksplit``) ``apply_deferred`` cuts K into that many slices instead: one strided-batched
cuBLAS product of views, [k_slices, tokens, out], more programs with shorter K loops, whose sum the kernel that
reads the product next adds as it reads it (``LinearOutput.partials``). ``apply`` is always the whole product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.linear.method import LinearMethod, WeightLayout
from engine.models.linear.output import LinearOutput

DECODE_KSPLIT_MAX_ROWS = 256  # decode-sized batches: the products that read their weight for few tokens


class UnquantizedLinearMethod(LinearMethod):
    """``k_slices``: how many slices of K ``apply_deferred`` cuts a decode-sized product into (1: none), for a
    layer without a bias whose K they cut into multiples of 64 columns; ``k_split``: the product's name in
    ``MINIVLLM_DECODE_KSPLIT`` (for the start-up log)."""

    def __init__(self, k_slices: int = 1, k_split: str | None = None):
        self.k_slices = k_slices
        self.k_split = k_split

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.add_param("weight", (layer.out_features, layer.in_features), dtype, WeightLayout())

    def process_after_loading(self, layer: nn.Module) -> None:
        shape = (layer.out_features, layer.in_features)
        if tuple(layer.weight.shape) != shape or not layer.weight.is_floating_point():
            raise ValueError(f"an unquantized linear layer needs a {shape} floating-point weight, has "
                             f"{tuple(layer.weight.shape)} {layer.weight.dtype}")
        if self.k_slices > 1 and (layer.bias is not None or layer.in_features % (64 * self.k_slices)):
            raise ValueError(f"{self.k_slices} slices of K need a layer without a bias whose {layer.in_features} "
                             f"input features cut into multiples of 64")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def apply_deferred(self, layer: nn.Module, x: torch.Tensor, partials_ok: bool = True) -> LinearOutput:
        if self.k_slices > 1 and partials_ok and x.dim() == 2 and x.shape[0] <= DECODE_KSPLIT_MAX_ROWS:
            partials = k_slice_products(x, layer.weight, self.k_slices)
            return LinearOutput(partials[0], partials=partials)
        return LinearOutput(F.linear(x, layer.weight, layer.bias))


def k_slice_products(x: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """``x @ weight.T`` ([tokens, K] x [out, K]) as the products of ``slices`` slices of K, [slices, tokens, out], in
    one strided-batched matmul of views (no copy): slice s is columns s*K/slices.. of x's rows and of the weight's."""
    k = x.shape[1]
    a = x.unflatten(1, (slices, k // slices)).transpose(0, 1)  # [slices, tokens, k / slices]
    w = weight.unflatten(1, (slices, k // slices)).permute(1, 2, 0)  # [slices, k / slices, out]
    return torch.bmm(a, w)
