"""The int4 and int8 methods' products on CUDA: when a layer's codes go to the Triton kernels of
``engine.ops.quant_matmul``, and which kernel each product takes by its token count.

* up to ``GEMV_MAX_ROWS`` tokens of an int4 layer: the GEMV of ``engine.ops.quant_gemv`` on the CUDA cores;
* up to ``DEQUANTIZE_FROM_ROWS`` tokens (decode steps, short prompts): ``quant_matmul``, which reads the codes and
  dequantizes them tile by tile; with K cut into slices (few output tiles for the SMs) ``apply_deferred`` hands
  the slices' partial products to the kernel that reads the product (``LinearOutput.partials``), as the 16-bit
  layers' K-split does, where that kernel adds them and the layer has no bias;
* more tokens (long prompts): W dequantized into a temporary in the compute dtype and multiplied on cuBLAS, whose
  tiles beat dequantizing inside every tile once the product is bound by the tensor cores, not by reading W.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.models.linear.output import LinearOutput

DEQUANTIZE_FROM_ROWS = 128  # products of this many tokens or more dequantize W and multiply on cuBLAS (H100: the
# fused kernel beat it up to 64 tokens, lost from 128; bench/RESULTS.md, 2026-12-07)


def cuda_quant_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                      group: int | None):
    """The ``QuantWeight`` the kernels read for a layer's parameters, or None where they do not serve it: not on
    CUDA, Triton missing, or K not cut into steps of 32 columns that fit the groups (``group`` None: one scale a
    row)."""
    if codes.device.type != "cuda":
        return None
    try:
        from engine.ops.quant_matmul import QuantWeight, block_k_for
    except ImportError:
        return None
    k = codes.shape[1] * (2 if bits == 4 else 1)
    group = k if group is None else group
    if block_k_for(k, group) is None:
        return None
    return QuantWeight(codes, scales, zeros, bits, group)


@functools.lru_cache(maxsize=4096)
def _tiles(m: int, n: int, k: int, group: int, bits: int, device_index: int):
    from engine.ops.quant_matmul import choose_product_tiles

    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return choose_product_tiles(m, n, k, group, bits, sms)


def cuda_kernels_apply(weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + bias`` for x [..., K] in the compute dtype."""
    from engine.ops.quant_matmul import dequantize, quant_matmul

    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] >= DEQUANTIZE_FROM_ROWS:
        return F.linear(x, dequantize(weight, x.dtype), bias)
    n, k = weight.shape
    tiles = _tiles(rows.shape[0], n, k, weight.group, weight.bits, x.device.index or 0)
    out = quant_matmul(rows.contiguous(), weight, tiles)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)


def cuda_kernels_apply_deferred(weight, x: torch.Tensor, bias: torch.Tensor | None,
                                partials_ok: bool) -> LinearOutput:
    """The product as a ``LinearOutput``: K's slices' partial products where the reader adds them."""
    from engine.ops.quant_matmul import quant_matmul_partials

    if partials_ok and bias is None and x.dim() == 2 and x.shape[0] < DEQUANTIZE_FROM_ROWS:
        n, k = weight.shape
        tiles = _tiles(x.shape[0], n, k, weight.group, weight.bits, x.device.index or 0)
        if tiles.split > 1:
            partials = quant_matmul_partials(x.contiguous(), weight, tiles)
            return LinearOutput(partials[0], partials=partials)
    return LinearOutput(cuda_kernels_apply(weight, x, bias))
