"""``MINIVLLM_DECODE_KSPLIT``: which decode-sized products are cut along K, into how many slices
(``UnquantizedLinearMethod.k_slices``).

A product can be cut where the kernel that reads it adds partial products as it reads them: q|k|v (the rope and
KV-cache write of a 16-bit cache), o and down (the residual add-norm), gate|up (SwiGLU). A model names those
products: a module lists the linear layers whose products its forward leaves to such a kernel in
``deferred_products`` (the Llama decoder's attention and MLP do), each named in the setting after its layer
(``qkv_proj`` is ``qkv``). ``use_decode_k_split`` gives them their slice counts when the model is built.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import settings
from engine.models.linear.layer import LinearBase
from engine.models.linear.unquantized import UnquantizedLinearMethod

DECODE_KSPLIT_PRODUCTS = ("qkv", "o", "gate_up", "down")
DECODE_KSPLIT_AUTO_MAX = 4  # "auto" cuts K into at most this many slices


def decode_k_split_setting() -> str:
    """``MINIVLLM_DECODE_KSPLIT`` as read (spaces dropped, lower case), ``auto`` where unset or empty."""
    return settings.decode_ksplit()


def auto_k_slices(in_features: int, out_features: int, device: torch.device) -> int:
    """``MINIVLLM_DECODE_KSPLIT=auto`` (the default): the slice count for a product of a [out_features, in_features]
    weight on ``device``. On a GPU, a product whose K is at least its output's width (o and down) has few output
    tiles at decode sizes: ~2 x out_features / 128 programs of 128 x 128 for up to 256 tokens, far fewer than the
    SMs, each running the whole of K. It is cut into the most slices, a power of two up to
    ``DECODE_KSPLIT_AUTO_MAX``, that keeps the programs within one per SM. Measured on an H100 (bench/RESULTS.md,
    2026-12-05): that picks o=4, down=4 on Qwen3-0.6B and o=2, down=2 on Llama-3.1-8B, the best counts
    ``bench/decode_gemm.py --ksplit`` found, and shortens W1's decode step by 1.1% and 1.3%; q|k|v and gate|up,
    wider than their K, gained nothing cut. Elsewhere (CPU) nothing is cut."""
    if device.type != "cuda" or in_features < out_features:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = 2 * -(-out_features // 128)
    slices = 1
    while (slices < DECODE_KSPLIT_AUTO_MAX and tiles * slices * 2 <= sms
           and in_features % (64 * slices * 2) == 0):
        slices *= 2
    return slices


def decode_k_slices(product: str, in_features: int, out_features: int | None = None,
                    device: torch.device | None = None) -> int:
    """How many slices of K ``product`` (one of ``DECODE_KSPLIT_PRODUCTS``) is cut into for decode-sized batches;
    1 for none. The setting is ``auto`` (the default: ``auto_k_slices`` for the weight's shape and device; whole
    where those are not given), one count for every such product (``2``), or counts by product
    (``qkv=2,o=4,gate_up=2,down=4``; a product not named stays whole); 0 and 1 mean none. A count that does not cut
    ``in_features`` into multiples of 64 columns leaves that product whole. An unknown product or a count outside
    0-16 is an error."""
    if product not in DECODE_KSPLIT_PRODUCTS:
        raise ValueError(f"decode_k_slices: no K-split for product {product!r} (one of {DECODE_KSPLIT_PRODUCTS})")
    value = decode_k_split_setting()
    if value == "auto":
        return 1 if out_features is None or device is None else auto_k_slices(in_features, out_features, device)
    if value.isdigit():
        counts = dict.fromkeys(DECODE_KSPLIT_PRODUCTS, value)
    else:
        counts = {}
        for item in value.split(","):
            name, _, count = item.partition("=")
            if name not in DECODE_KSPLIT_PRODUCTS or name in counts:
                raise ValueError(f"MINIVLLM_DECODE_KSPLIT: {name!r} is not a product that can be cut along K or is "
                                 f"named twice (products: {', '.join(DECODE_KSPLIT_PRODUCTS)}), in {value!r}")
            counts[name] = count
    for name, count in counts.items():
        if not count.isdigit() or int(count) > 16:
            raise ValueError(f"MINIVLLM_DECODE_KSPLIT must be auto or give slice counts from 0 to 16 (one count, or "
                             f"product=count pairs such as qkv=2,o=4,gate_up=2,down=4), got {count!r} for {name}")
    slices = int(counts.get(product, "1"))
    return slices if slices > 1 and in_features % (64 * slices) == 0 else 1


def use_decode_k_split(model: nn.Module) -> None:
    """Give each product a module of ``model`` lists in ``deferred_products`` its slice count (when the model is
    built, before loading): 16-bit weights without a bias only, and on one rank only where the ranks' products of
    a row-parallel layer are summed (an all-reduce of partial products would be no saving)."""
    for module in model.modules():
        for layer_name in getattr(module, "deferred_products", ()):
            layer = getattr(module, layer_name)
            if not isinstance(layer, LinearBase) or type(layer.method) is not UnquantizedLinearMethod:
                continue  # a quantized layer (an integer checkpoint's) keeps its method
            product = layer_name.removesuffix("_proj")
            slices = decode_k_slices(product, layer.in_features, layer.out_features, layer.weight.device)
            if slices > 1 and layer.bias is None and layer.input_shard is None:
                layer.set_method(UnquantizedLinearMethod(slices, product))


def decode_k_split_summary(model: nn.Module) -> str:
    """The model's products cut along K and into how many slices, for the start-up log: "" for none, else e.g.
    "o: 4 slices, down: 4 slices" (a product cut into different counts in different layers lists each)."""
    cuts: dict[str, set[int]] = {}
    for module in model.modules():
        method = getattr(module, "method", None)
        if isinstance(module, LinearBase) and isinstance(method, UnquantizedLinearMethod) and method.k_slices > 1:
            cuts.setdefault(method.k_split, set()).add(method.k_slices)
    return ", ".join(f"{name}: {'/'.join(map(str, sorted(cuts[name])))} slices"
                     for name in DECODE_KSPLIT_PRODUCTS if name in cuts)
