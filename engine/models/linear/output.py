"""``LinearOutput``: a linear layer's product as it leaves the layer, with the step that finishes it.

A product's last elementwise step may be left to the kernel that reads the product next, which does it as it
reads (one pass over the activations fewer, or shorter K loops at decode sizes):

* **column scales** (FP8 weights, prefill-sized batches): cuBLAS multiplied on 128 x 128 tiles of ones, so each
  column still needs its output channel's scale; the reader multiplies in float32 and rounds once;
* **partial products** (16-bit weights, decode-sized batches, ``MINIVLLM_DECODE_KSPLIT``): the product came as the
  products of K's slices, [num_slices, num_tokens, out_features]; the reader adds them in float32 and rounds once.

The readers: the KV-cache write after q|k|v (``Attention``'s ``column_scales`` and ``partials``), the residual
add-norm after o and down (``RMSNorm``), SwiGLU after gate|up (``SiluAndMul``). ``finished`` is the same
arithmetic in torch, for everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LinearOutput:
    """The product of ``LinearBase.forward_deferred``; at most one of ``column_scales`` and ``partials`` is set.

    ``values`` [num_tokens, out_features] in the model dtype: the product, or, with ``partials``, its first
    slice (a view of it, which q|k|v's views are cut from); ``column_scales`` float32 [out_features]: what each
    column still needs multiplying by; ``partials`` [num_slices, num_tokens, out_features]: slices whose sum is the
    product."""

    values: torch.Tensor
    column_scales: torch.Tensor | None = None
    partials: torch.Tensor | None = None

    def finished(self) -> torch.Tensor:
        """The product itself, [num_tokens, out_features], rounded as the fused readers round it."""
        if self.partials is not None:
            return sum_partials(self.partials)
        if self.column_scales is not None:
            return (self.values.float() * self.column_scales).to(self.values.dtype)
        return self.values


def sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """[num_slices, num_tokens, n] partial products -> their sum [num_tokens, n], added in float32, rounded once."""
    return partials.float().sum(0).to(partials.dtype)
