"""A GGUF file's quantized linear weights served in their blocks: what ``--quantization`` unset (or ``gguf``) does
for a GGUF model; ``none`` loads the converted directory's dequantized weights instead.

The model is still built from the file's converted directory (``engine.loading.gguf``: config, tokenizer, and every
other tensor dequantized to float32). Before loading, each linear layer gets a method by the GGML types of its
GGUF tensors (``KEPT_TYPES``; the conversions are ``engine.loading.gguf_blocks`` and ``gguf_kquants``):

    all Q4_0, Q4_1 or Q4_K                          int4 (``Int4LinearMethod(32)``): 4 bits a weight, as the file
    all of one other kept type (Q5_0, Q5_1, Q5_K,   int8 (``Int8LinearMethod``): groups of 32, 16 for Q6_K, zeros
      Q6_K, Q8_0)                                   where the type has a minimum (Q5_1, Q5_K)
    parts of different kept types, not all int4     int8 at the finest group of its parts, with zeros where any
      (q|k Q4_K with v Q6_K, as in Q4_K_M files)    part has them: coarser groups' scales and zeros repeated,
                                                    4-bit codes held in 8 bits, a zero of 0 for a part without
    any part of another type (F16, BF16, Q2_K,      keeps its method and loads the dequantized weight
      Q3_K, IQ types, ...)

Every kept layer's weights are exactly the ones ``gguf`` dequantizes, in float32 (but for the int4 zeros of Q4_1
and Q4_K, exact for the scales quantizers make: ``gguf_blocks``). The start-up log counts the layers each way and
names the types behind them (``log_weight_bytes``). The converted directory's stream of tensors is then read with
the kept layers' dequantized weights left out and their blocks put in under the names the methods' parameters load
from (``model.layers.0.self_attn.q_proj.qweight``, ``.scales``, ``.zeros``), so that q|k|v parts and
tensor-parallel shards are cut by the parameters' WeightLayouts like any checkpoint's.

llama.cpp stores a Llama's Q and K rows permuted for its rotary layout (row pairs 2i, 2i + 1 of a head rotate
together, where Hugging Face rotates row i with row i + head_dim / 2); transformers puts them back when it
dequantizes, and so is it done here, on whole rows of codes, scales and zeros: a block lies within one row, so the
blocks stay intact.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.distributed import tp_size
from engine.loading.gguf_blocks import (
    GGUF_BLOCK,
    q4_0_to_int4,
    q4_0_to_int8,
    q4_1_to_int4,
    q4_1_to_int8,
    q5_0_to_int8,
    q5_1_to_int8,
    q8_0_to_int8,
)
from engine.loading.gguf_kquants import q4_k_to_int4, q4_k_to_int8, q5_k_to_int8, q6_k_to_int8
from engine.models.embedding import ParallelLMHead
from engine.models.linear import (
    Int4LinearMethod,
    Int8LinearMethod,
    LinearMethod,
    linear_layers,
    set_linear_methods,
)
from engine.models.linear.int4 import INT4_HEAD_MAX_TOKENS, CpuInt4OpWeight

logger = logging.getLogger("minivllm")

PERMUTED_ARCHITECTURES = ("llama",)  # GGUF architectures whose Q and K rows llama.cpp permutes
# A float32 model on the CPU runs the int4 layers' op in bfloat16 (``Int4LinearMethod``'s float32_in_bfloat16): the
# default model's perplexity moves by +0.04% (tests/test_gguf_quantized.py), its decode-sized products run 2x faster.
FLOAT32_IN_BFLOAT16 = True
CATEGORIES = ("int4", "int8", "mixed->int8", "dequantized")  # how a layer holds its weight, as the log counts them


@dataclass(frozen=True)
class BlockType:
    """A kept GGML type: its int8 form (codes, scales, zeros or None) with its group and whether it has zeros,
    and its int4 form (codes, scales, zeros; groups of 32) where its codes fit 4 bits."""

    int8: Callable
    group: int
    zeros: bool
    int4: Callable | None = None


KEPT_TYPES = {  # by ``GGMLQuantizationType`` name
    "Q4_0": BlockType(q4_0_to_int8, GGUF_BLOCK, False, q4_0_to_int4),
    "Q4_1": BlockType(q4_1_to_int8, GGUF_BLOCK, True, q4_1_to_int4),
    "Q4_K": BlockType(q4_k_to_int8, GGUF_BLOCK, True, q4_k_to_int4),
    "Q5_0": BlockType(q5_0_to_int8, GGUF_BLOCK, False),
    "Q5_1": BlockType(q5_1_to_int8, GGUF_BLOCK, True),
    "Q5_K": BlockType(q5_k_to_int8, GGUF_BLOCK, True),
    "Q6_K": BlockType(q6_k_to_int8, 16, False),
    "Q8_0": BlockType(q8_0_to_int8, GGUF_BLOCK, False),
}


@dataclass(frozen=True)
class Held:
    """How a layer holds its GGUF tensors: "int4" (groups of 32, zeros) or "int8" (``group``, ``zeros``)."""

    kind: str
    group: int
    zeros: bool

    @staticmethod
    def of(type_names: list[str]) -> Held | None:
        """The form for a layer whose parts are of ``type_names``; None where one of them is not kept."""
        if not type_names or any(name not in KEPT_TYPES for name in type_names):
            return None
        types = [KEPT_TYPES[name] for name in type_names]
        if all(t.int4 is not None for t in types):
            return Held("int4", GGUF_BLOCK, True)
        return Held("int8", min(t.group for t in types), any(t.zeros for t in types))

    def method(self) -> LinearMethod:
        if self.kind == "int4":
            return Int4LinearMethod(self.group, FLOAT32_IN_BFLOAT16)
        return Int8LinearMethod(self.group, zeros=self.zeros)

    def param_names(self) -> tuple[str, ...]:
        return ("qweight", "scales", "zeros") if self.zeros else ("qweight", "scales")

    def convert(self, data: np.ndarray, type_name: str) -> tuple[torch.Tensor, ...]:
        """A tensor's blocks as this form's parameters (``param_names``)."""
        block_type = KEPT_TYPES[type_name]
        if self.kind == "int4":
            return block_type.int4(data)
        codes, scales, zeros = block_type.int8(data)
        repeat = block_type.group // self.group  # a coarser part's scales and zeros, once per finer group
        if zeros is None and self.zeros:
            zeros = torch.zeros_like(scales)
        groups = (scales, zeros) if self.zeros else (scales,)
        return codes, *(t.repeat_interleave(repeat, dim=-1) if repeat > 1 else t for t in groups)


@dataclass
class GgufWeights:
    """The GGUF tensors that replace the converted directory's: by Hugging Face name of the dequantized weight
    (``model.layers.0.self_attn.q_proj.weight``), its GGUF tensor and the form its layer holds it in."""

    reader: object  # gguf.GGUFReader
    architecture: str
    num_heads: int
    num_kv_heads: int
    tensors: dict[str, tuple[object, Held]] = field(default_factory=dict)
    # layers by category (CATEGORIES), each a count by the GGML types behind it: "Q4_K", "Q4_K+Q6_K" (a fused
    # layer's parts), and for "dequantized" the types that are not kept ("Q3_K", "F16")
    layers: dict[str, Counter] = field(default_factory=lambda: {category: Counter() for category in CATEGORIES})

    def stream(self, weights: Iterator[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """``weights`` (the converted directory's tensors) with the replaced weights left out, then the blocks
        of those weights as the int4 and int8 methods' parameters."""
        for name, tensor in weights:
            if name not in self.tensors:
                yield name, tensor
        for name, (tensor, held) in self.tensors.items():
            base = name.removesuffix(".weight")
            for param, value in zip(held.param_names(), self._blocks(name, tensor, held)):
                yield f"{base}.{param}", value

    def _blocks(self, name: str, tensor, held: Held) -> tuple[torch.Tensor, ...]:
        parts = held.convert(np.asarray(tensor.data), tensor.tensor_type.name)
        heads = self._permuted_heads(name)
        if heads is not None:
            parts = tuple(hf_rows(part, heads) for part in parts)
        return parts

    def _permuted_heads(self, name: str) -> int | None:
        if self.architecture not in PERMUTED_ARCHITECTURES:
            return None
        return {"q_proj": self.num_heads, "k_proj": self.num_kv_heads}.get(name.split(".")[-2])

    def count(self, held: Held | None, type_names: list[str]) -> None:
        """Count a layer (its parts' types, None for a part the file lacks) under its category."""
        if held is None:
            unkept = {name or "no GGUF tensor" for name in type_names if name not in KEPT_TYPES} or {"no GGUF tensor"}
            self.layers["dequantized"]["+".join(sorted(unkept))] += 1
            return
        distinct = sorted(set(type_names))
        category = "int4" if held.kind == "int4" else "int8" if len(distinct) == 1 else "mixed->int8"
        self.layers[category]["+".join(distinct)] += 1


def hf_rows(values: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a Llama Q or K weight (or of its codes, scales or zeros) from llama.cpp's order back to Hugging
    Face's: in each head, rows 2i and 2i + 1 go to i and i + head_dim / 2."""
    half = values.shape[0] // num_heads // 2
    return values.reshape(num_heads, half, 2, *values.shape[1:]).transpose(1, 2).reshape(values.shape).contiguous()


def use_gguf_methods(model: nn.Module, gguf_path: Path, num_heads: int, num_kv_heads: int) -> GgufWeights:
    """Before loading: give each linear layer whose GGUF tensors are all of kept types its int4 or int8 method.
    Returns what replaces the converted directory's tensors when loading (``GgufWeights.stream``)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(architecture)
    if arch is None:
        raise ValueError(f"{gguf_path.name}: gguf does not know the architecture {architecture!r}")
    blocks = 1 + max((int(name.split(".")[1]) for name in by_name if name.startswith("blk.")), default=-1)
    name_map = gguf.get_tensor_name_map(arch, blocks)
    found = GgufWeights(reader, architecture, num_heads, num_kv_heads)

    def choose(name: str, layer: nn.Module) -> LinearMethod | None:
        sources = {}
        for checkpoint_name in layer.weight_targets(name):
            if checkpoint_name.endswith(".weight"):
                gguf_name = name_map.get_name(checkpoint_name, try_suffixes=(".weight",))  # blk.0.attn_q.weight
                sources[checkpoint_name] = by_name.get(gguf_name) if gguf_name else None
        type_names = [None if t is None else t.tensor_type.name for t in sources.values()]
        held = Held.of(type_names)
        found.count(held, type_names)
        if held is None:
            return None
        found.tensors.update({n: (t, held) for n, t in sources.items()})
        return held.method()

    set_linear_methods(model, choose)
    return found


def log_weight_bytes(model: nn.Module, found: GgufWeights, head: str = "") -> None:
    """At start-up: how many linear layers are kept in each form and of which GGML types, which types were
    dequantized, and the bytes of the kept layers' codes, scales and zeros against what their dequantized weights
    take in the compute dtype (and the copies dequantized for the product where no int4 or int8 op serves the
    device, dtype and group)."""
    kept = dequantized = copies = with_copy = 0
    for _, layer in linear_layers(model):
        if isinstance(layer.method, (Int4LinearMethod, Int8LinearMethod)):
            params = [getattr(layer, name) for name in layer.param_layouts if name != "bias"]
            kept += sum(param.numel() * param.element_size() for param in params)
            dequantized += layer.out_features * layer.in_features * layer.scales.element_size()
            copy = getattr(layer, "dequantized_weight", None)
            if copy is not None:
                copies += copy.numel() * copy.element_size()
                with_copy += 1
    logger.info("GGUF linear layers: %s; the kept layers' codes, scales and zeros take %.1f MiB, dequantized they "
                "would take %.1f MiB%s (--quantization none dequantizes every layer)%s", layer_counts(found),
                kept / 2**20, dequantized / 2**20,
                f" ({with_copy} of them hold a dequantized copy for the product, {copies / 2**20:.1f} MiB)"
                if with_copy else "", f"; {head}" if head else "")


def layer_counts(found: GgufWeights) -> str:
    """"84 int4 (Q4_K: 84), 14 int8 (Q6_K: 14), 14 mixed->int8 (Q4_K+Q6_K: 14), 12 dequantized (Q3_K: 12)"."""
    counts = []
    for category in CATEGORIES:
        by_types = found.layers[category]
        detail = ", ".join(f"{types}: {n}" for types, n in sorted(by_types.items()))
        counts.append(f"{sum(by_types.values())} {category}" + (f" ({detail})" if detail else ""))
    return ", ".join(counts)


def keep_lm_head(model: nn.Module, found: GgufWeights) -> str:
    """After loading, on the CPU: the LM head's GGUF tensor (``output.weight``, or ``token_embd.weight`` where the
    embeddings are tied) kept in its blocks beside the dense weight (``CpuInt4OpWeight``: int4 types as they are,
    the other kept types as their int8 form in two 4-bit planes), to find the greedy tokens of steps of up to
    ``INT4_HEAD_MAX_TOKENS`` rows whose sampling needs nothing else of the logits. Its products are in bfloat16,
    so they only narrow each row to the few ids that may be its argmax; those are multiplied by the dense weight.
    Every logit a sampler or a client sees still comes from the dense weight. Returns what the start-up log says."""
    heads = [module for module in model.modules() if isinstance(module, ParallelLMHead)]
    by_name = {tensor.name: tensor for tensor in found.reader.tensors}
    tensor = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if len(heads) != 1 or tensor is None:
        return "the LM head is dense (no GGUF tensor for it)"
    head, type_name = heads[0], tensor.tensor_type.name
    block_type = KEPT_TYPES.get(type_name)
    if block_type is None:
        return f"the LM head ({type_name}) is dense"
    group = GGUF_BLOCK if block_type.int4 is not None else block_type.group
    if head.weight.device.type != "cpu" or tp_size() > 1 or head.weight.dtype not in (torch.float32, torch.bfloat16):
        return f"the LM head ({type_name}) is dense: its blocks are kept on a CPU, on one rank"
    if not CpuInt4OpWeight.usable(head.out_features, group):
        return (f"the LM head ({type_name}) is dense: torch's CPU int4 op does not take its groups of {group} or its "
                f"{head.out_features} rows")
    data = np.asarray(tensor.data)
    if block_type.int4 is not None:
        form, weight = "int4", CpuInt4OpWeight.from_int4(*block_type.int4(data), group)
    else:
        form, weight = "int8 as two 4-bit planes", CpuInt4OpWeight.from_int8(*block_type.int8(data), group)
    if weight.out_features != head.out_features:
        return f"the LM head ({type_name}) is dense: its GGUF tensor has {weight.out_features} rows"
    head.argmax_form, head.argmax_max_rows = weight, INT4_HEAD_MAX_TOKENS
    return (f"the LM head's {type_name} blocks are kept beside its dense weight ({form}, {weight.nbytes / 2**20:.1f} "
            f"MiB) to find greedy tokens, up to {INT4_HEAD_MAX_TOKENS} rows a step")
