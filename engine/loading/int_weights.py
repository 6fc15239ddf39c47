"""Integer checkpoints at load time: which ``quantization_config`` formats are served, and which method each linear
layer gets.

One reader per format family turns the config into an ``IntScheme`` (ValueError naming what is not supported, when
the config is read: ``ModelConfig``), whose ``recipe(module)`` says how one checkpoint module (``model.layers.0.
self_attn.q_proj``) is stored: a ``CheckpointLayout`` (``engine.models.linear.awq``, ``gptq``, ``compressed``) served
by ``Int4CheckpointMethod`` or ``Int8CheckpointMethod``, ``W8A8`` (``W8A8LinearMethod``), or None: kept
unquantized (``modules_to_not_convert``, GPTQ's ``modules_in_block_to_quantize``, compressed-tensors' ``ignore``).

    awq                  GEMM layout, 4 bits, zero points or not, any group size (GEMV, Marlin, ExLlama refused)
    gptq                 4 bits (int4), 8 bits symmetric (int8); sym or not, desc_act, checkpoint formats gptq / gptq_v2
    compressed-tensors   pack-quantized int4 / int8 weights (group or channel, symmetric or not), int-quantized int8
                         weights with dynamic per-token int8 activations (W8A8) or without (W8A16)

The LM head and the fused MoE experts take 16/32-bit weights only: a checkpoint that quantizes them is refused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from engine.models.linear import linear_layers, set_linear_methods
from engine.models.linear.awq import AwqLayout
from engine.models.linear.compressed import IntWeightLayout, PackedLayout
from engine.models.linear.gptq import GptqLayout
from engine.models.linear.int_checkpoint import CheckpointLayout, Int4CheckpointMethod, Int8CheckpointMethod
from engine.models.linear.w8a8 import W8A8LinearMethod

logger = logging.getLogger("minivllm")

INT_QUANT_METHODS = ("awq", "gptq", "compressed-tensors")
SUPPORTED = ("fp8 (block-scaled FP8 checkpoints), awq (GEMM layout, 4 bits), gptq (4 bits, 8 bits symmetric), "
             "compressed-tensors (pack-quantized int4/int8 weights, int-quantized W8A8 and W8A16)")


class W8A8:
    """The recipe of compressed-tensors' W8A8 layers (``W8A8LinearMethod``)."""

    @staticmethod
    def describe() -> str:
        return ("compressed-tensors int-quantized W8A8: int8 weights with a scale per channel, int8 activations "
                "quantized per token at run time")


Recipe = CheckpointLayout | type[W8A8]


@dataclass(frozen=True)
class IntScheme:
    """A checkpoint's integer quantization: its format's name, and each checkpoint module's recipe (None: not
    quantized)."""

    name: str
    recipe: Callable[[str], Recipe | None]


def int_scheme(quant: dict) -> IntScheme:
    """The scheme of a ``quantization_config`` whose ``quant_method`` is one of ``INT_QUANT_METHODS``."""
    quant = {key: getattr(value, "value", value) for key, value in quant.items()}  # transformers' enums: their str
    method = quant.get("quant_method")
    readers = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}
    if method not in readers:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; supported: {SUPPORTED}")
    return readers[method](quant)


def _group_size(value, what: str) -> int | None:
    """A config's group size: None for -1 (one group across the input), else a positive multiple of 8."""
    group = int(value)
    if group == -1:
        return None
    if group < 8 or group % 8:
        raise ValueError(f"{what} group_size {group} is not supported (-1 or a positive multiple of 8 are)")
    return group


def _skipped(module: str, skip: tuple[str, ...]) -> bool:
    """``modules_to_not_convert``: a module whose name contains one of them stays unquantized."""
    return any(name and name in module for name in skip)


def _awq(quant: dict) -> IntScheme:
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"AWQ checkpoints of {bits} bits are not supported (4 bits are)")
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported: only the GEMM layout (version 'gemm') is; GEMV, "
                         f"GEMV-fast, Marlin and ExLlama checkpoints pack their words otherwise")
    layout = AwqLayout(_group_size(quant.get("group_size", quant.get("q_group_size", 128)), "AWQ"),
                       bool(quant.get("zero_point", True)))
    skip = tuple(quant.get("modules_to_not_convert") or ())
    return IntScheme("AWQ", lambda module: None if _skipped(module, skip) else layout)


def _gptq(quant: dict) -> IntScheme:
    bits = int(quant.get("bits", 4))
    fmt = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
    versions = {"gptq": 1, "gptq_v2": 2}
    if fmt not in versions:
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq and gptq_v2 are; Marlin, BitBLAS "
                         f"and other kernels' formats pack their words otherwise)")
    sym, desc_act = bool(quant.get("sym", True)), bool(quant.get("desc_act", False))
    if bits == 8 and not sym:
        raise ValueError("8-bit GPTQ checkpoints with zero points (sym: false) are not supported: the int8 method has "
                         "none (8-bit sym: true, and 4-bit either way, are)")
    if quant.get("lm_head"):
        raise ValueError("GPTQ checkpoints with a quantized LM head (lm_head: true) are not supported: the LM head "
                         "takes 16/32-bit weights")
    if quant.get("dynamic"):
        raise ValueError("GPTQ's per-module overrides (dynamic) are not supported")
    if str(quant.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise ValueError(f"GPTQ pack_dtype {quant.get('pack_dtype')!r} is not supported (int32 is)")
    layout = GptqLayout(bits, _group_size(quant.get("group_size", 128), "GPTQ"), versions[fmt], desc_act, sym)
    skip = tuple(quant.get("modules_to_not_convert") or ())
    blocks = quant.get("modules_in_block_to_quantize")
    only = None if not blocks else tuple(name for block in blocks for name in block)

    def recipe(module: str) -> Recipe | None:
        if _skipped(module, skip) or (only is not None and not any(module.endswith(f".{m}") for m in only)):
            return None
        return layout

    return IntScheme("GPTQ", recipe)


def _compressed_tensors(quant: dict) -> IntScheme:
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"compressed-tensors checkpoints in quantization_status {status!r} are not supported (their "
                         f"weights must be stored compressed)")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if quant.get(key):
            raise ValueError(f"compressed-tensors {key} is not supported")
    groups = []
    for name, group in (quant.get("config_groups") or {}).items():
        if not isinstance(group, dict):
            raise ValueError(f"compressed-tensors config group {name!r}: preset scheme names are not supported")
        groups.append((list(group.get("targets") or []), _compressed_recipe(name, group, quant.get("format"))))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    ignore = list(quant.get("ignore") or [])

    def recipe(module: str) -> Recipe | None:
        if _matches(module, ignore, linear=False):
            return None
        return next((found for targets, found in groups if _matches(module, targets, linear=True)), None)

    if recipe("lm_head") is not None:
        raise ValueError("this compressed-tensors checkpoint quantizes the LM head (lm_head is not in its ignore "
                         "list): the LM head takes 16/32-bit weights")
    return IntScheme("compressed-tensors", recipe)


def _matches(module: str, targets: list[str], linear: bool) -> bool:
    """compressed-tensors' targets and ignore: a module name, ``re:`` and a regular expression, or (targets) the
    class name ``Linear``, which every linear layer is."""
    for target in targets:
        if target == module or (linear and target == "Linear"):
            return True
        if target.startswith("re:") and re.match(target[3:], module):
            return True
    return False


def _compressed_recipe(name: str, group: dict, top_format: str | None) -> Recipe:
    """One config group's recipe; ValueError for what is not supported."""
    fmt, weights, inputs = group.get("format") or top_format, group.get("weights"), group.get("input_activations")
    what = f"compressed-tensors config group {name!r}"
    if not weights or group.get("output_activations"):
        raise ValueError(f"{what}: only quantized weights (and int8 input activations) are supported")
    kind, bits, strategy = weights.get("type", "int"), int(weights.get("num_bits", 8)), weights.get("strategy")
    if kind != "int":
        raise ValueError(f"{what}: {kind} weights are not supported (integer weights are; FP8 checkpoints are "
                         f"served in Hugging Face's fp8 format)")
    if strategy not in ("group", "channel") or weights.get("dynamic"):
        raise ValueError(f"{what}: weight strategy {strategy!r} is not supported (static group and channel are)")
    if weights.get("actorder") in (True, "group", "dynamic"):
        raise ValueError(f"{what}: actorder 'group' (weights in act order, with weight_g_idx) is not supported")
    group_size = _group_size(weights.get("group_size"), what) if strategy == "group" else None
    symmetric = bool(weights.get("symmetric", True))
    if bits == 8 and not symmetric:
        raise ValueError(f"{what}: asymmetric 8-bit weights are not supported (the int8 method has no zero points)")
    if fmt == "pack-quantized" and inputs is None:
        return PackedLayout(bits, group_size, symmetric)
    if fmt in ("int-quantized", "naive-quantized") and bits == 8:
        if inputs is None:
            return IntWeightLayout(group_size)
        dynamic_tokens = (inputs.get("type", "int"), int(inputs.get("num_bits", 8)), inputs.get("strategy"),
                          bool(inputs.get("dynamic")), bool(inputs.get("symmetric", True)))
        if dynamic_tokens != ("int", 8, "token", True, True) or group_size is not None:
            raise ValueError(f"{what}: of int8 activations only dynamic, symmetric, per-token ones with one weight "
                             f"scale per channel (W8A8) are supported")
        return W8A8
    raise ValueError(f"{what}: format {fmt!r} with {bits}-bit weights{' and quantized inputs' if inputs else ''} is "
                     f"not supported (pack-quantized int4/int8 weights, int-quantized int8 weights are)")


# ------------------------------------------------------------------------------------------ the model's layers


def _method(recipe: Recipe, layer: nn.Module):
    if recipe is W8A8:
        return W8A8LinearMethod()
    if recipe.bits == 4:
        return Int4CheckpointMethod(recipe, recipe.method_group(layer))
    return Int8CheckpointMethod(recipe, recipe.group_size)


def use_int_methods(model: nn.Module, quant: dict, moe: bool, quantization: str | None) -> int:
    """Before loading: give each linear layer the method its checkpoint modules are stored for (the parts of a
    fused layer must agree). Returns how many layers load quantized."""
    scheme = int_scheme(quant)
    if quantization is not None:
        raise ValueError(f"this checkpoint is quantized already ({scheme.name}): quantization={quantization!r} "
                         f"does not apply to it")
    if moe:
        raise ValueError(f"mixture-of-experts models in {scheme.name} checkpoints are not supported: their experts' "
                         f"weights are quantized, and the fused experts take 16/32-bit weights")
    kept = {"quantized": 0, "unquantized": 0}
    descriptions = set()

    def choose(name: str, layer: nn.Module):
        modules = sorted({target.rpartition(".")[0] for target in layer.weight_targets(name)})
        recipes = {id(r): r for r in map(scheme.recipe, modules)}
        if len(recipes) > 1:
            raise ValueError(f"{name}: its parts ({', '.join(modules)}) are stored in different formats; a fused "
                             f"layer takes one")
        recipe = next(iter(recipes.values()))
        kept["quantized" if recipe is not None else "unquantized"] += 1
        if recipe is None:
            return None
        descriptions.add(recipe.describe())
        return _method(recipe, layer)

    set_linear_methods(model, choose)
    logger.info("%s: %d linear layers load quantized, %d unquantized",
                "; ".join(sorted(descriptions)) or f"{scheme.name} checkpoint", kept["quantized"], kept["unquantized"])
    return kept["quantized"]


def log_weight_bytes(model: nn.Module) -> None:
    """At start-up: the quantized layers' weights, as held, against their size in the compute dtype (and the copies
    dequantized for the product where no int4 or int8 product serves the device and dtype)."""
    methods = (Int4CheckpointMethod, Int8CheckpointMethod, W8A8LinearMethod)
    held = full = copies = with_copy = layers = 0
    dtype = None
    for _, layer in linear_layers(model):
        if not isinstance(layer.method, methods):
            continue
        layers, dtype = layers + 1, layer.compute_dtype
        held += sum(p.numel() * p.element_size() for name, p in layer.named_parameters(recurse=False)
                    if name != "bias")
        full += layer.out_features * layer.in_features * dtype.itemsize
        copy = getattr(layer, "dequantized_weight", None)
        if copy is None:
            copy = getattr(layer, "widened_weight", None)
        if copy is not None:
            copies += copy.numel() * copy.element_size()
            with_copy += 1
    if layers:
        logger.info("quantized linear layers: %d, weights and scales %.1f MiB (in %s they would take %.1f MiB)%s",
                    layers, held / 2**20, str(dtype).removeprefix("torch."), full / 2**20,
                    f"; {with_copy} of them hold a dequantized copy for the product, {copies / 2**20:.1f} MiB"
                    if with_copy else "")
