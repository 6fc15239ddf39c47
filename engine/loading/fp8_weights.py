"""FP8 weights at load time: which linear layers go FP8, and with which ``Fp8LinearMethod``: an FP8 checkpoint's
block layout (its tensors load as stored), or ``--quantization fp8`` (the model dtype's weights quantized after
loading, one scale per output channel)."""

from __future__ import annotations

import torch

from engine.models.fp8 import Fp8Scheme
from engine.models.linear import Fp8LinearMethod, linear_layers, process_weights_after_loading, set_linear_methods


def quantizable_linears(model: torch.nn.Module, skip: tuple[str, ...] = ()):
    """(name, layer) of the linear layers that go FP8: the attention and MLP projections. Embeddings, norms, the
    LM head, routers and fused experts stay in the compute dtype."""
    for name, layer in linear_layers(model):
        if not any(s and s in name for s in skip):
            yield name, layer


def use_fp8_methods(model: torch.nn.Module, scheme: Fp8Scheme | None) -> int:
    """Before loading: give each quantizable linear FP8 parameters, in an FP8 checkpoint's layout (``scheme``, so
    that its FP8 tensors and ``weight_scale_inv`` scales are copied in as stored) or, for ``--quantization fp8``
    (``scheme`` None), to be quantized after loading. Returns how many layers changed."""
    if scheme is not None and scheme.block is None:
        raise ValueError("FP8 checkpoints without weight_block_size (one scale per tensor) are not supported")
    method = Fp8LinearMethod(scheme.block if scheme is not None else None)
    names = {name for name, _ in quantizable_linears(model, scheme.modules_to_not_convert if scheme else ())}
    return set_linear_methods(model, lambda name, layer: method if name in names else None)


@torch.no_grad()
def quantize_model_weights(model: torch.nn.Module) -> int:
    """``--quantization fp8`` on a model whose weights are in place already: every quantizable linear's weight
    replaced by FP8 and per-channel scales, one layer at a time (the peak stays at the unquantized model).
    Returns how many layers changed."""
    count = use_fp8_methods(model, None)
    process_weights_after_loading(model)
    return count


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (FP8 weights and their scales counted as stored)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
