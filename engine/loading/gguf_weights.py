"""A GGUF file's Q4_0, Q4_1 and Q8_0 linear weights served in their blocks: what ``--quantization`` unset (or
``gguf``) does for a GGUF model; ``none`` loads the converted directory's dequantized weights instead.

The model is still built from the file's converted directory (``engine.loading.gguf``: config, tokenizer, and every
other tensor dequantized to float32). Before loading, each linear layer whose GGUF tensors are all Q4_0 or Q4_1
gets ``Int4LinearMethod(32)``, all Q8_0 ``Int8LinearMethod(32)``; the others (K-quants, F16, a fused layer whose
parts differ in kind, e.g. q in Q4_0 and v in Q8_0) keep their method and load the dequantized weight. The
converted directory's stream of tensors is then read with those layers' dequantized weights left out and their
blocks (``engine.loading.gguf_blocks``) put in under the names the methods' parameters load from
(``model.layers.0.self_attn.q_proj.qweight``, ``.scales``, ``.zeros``), so that q|k|v parts and tensor-parallel
shards are cut by the parameters' WeightLayouts like any checkpoint's.

llama.cpp stores a Llama's Q and K rows permuted for its rotary layout (row pairs 2i, 2i + 1 of a head rotate
together, where Hugging Face rotates row i with row i + head_dim / 2); transformers puts them back when it
dequantizes, and so is it done here, on whole rows of codes, scales and zeros: a block lies within one row, so the
blocks stay intact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.loading.gguf_blocks import GGUF_BLOCK, INT4_BLOCK_TYPES, INT8_BLOCK_TYPES
from engine.models.linear import (
    Int4LinearMethod,
    Int8LinearMethod,
    linear_layers,
    set_linear_methods,
)

logger = logging.getLogger("minivllm")

PERMUTED_ARCHITECTURES = ("llama",)  # GGUF architectures whose Q and K rows llama.cpp permutes
# A float32 model on the CPU runs the int4 layers' op in bfloat16 (``Int4LinearMethod``'s float32_in_bfloat16): the
# default model's perplexity moves by +0.04% (tests/test_gguf_quantized.py), its decode-sized products run 2x faster.
FLOAT32_IN_BFLOAT16 = True


@dataclass
class GgufWeights:
    """The GGUF tensors that replace the converted directory's: by Hugging Face name of the dequantized weight
    (``model.layers.0.self_attn.q_proj.weight``), its GGUF tensor and the method kind ("int4", "int8")."""

    reader: object  # gguf.GGUFReader
    architecture: str
    num_heads: int
    num_kv_heads: int
    tensors: dict[str, tuple[object, str]] = field(default_factory=dict)
    layers: dict[str, int] = field(default_factory=dict)  # kept-quantized layers by kind, and "dequantized"

    def stream(self, weights: Iterator[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """``weights`` (the converted directory's tensors) with the replaced weights left out, then the blocks
        of those weights as the int4 and int8 methods' parameters."""
        for name, tensor in weights:
            if name not in self.tensors:
                yield name, tensor
        for name, (tensor, kind) in self.tensors.items():
            base = name.removesuffix(".weight")
            for param, value in zip(PARAM_NAMES[kind], self._blocks(name, tensor, kind)):
                yield f"{base}.{param}", value

    def _blocks(self, name: str, tensor, kind: str) -> tuple[torch.Tensor, ...]:
        data = np.asarray(tensor.data)
        convert = {**INT4_BLOCK_TYPES, **INT8_BLOCK_TYPES}[tensor.tensor_type.name]
        parts = convert(data)
        heads = self._permuted_heads(name)
        if heads is not None:
            parts = tuple(hf_rows(part, heads) for part in parts)
        return parts

    def _permuted_heads(self, name: str) -> int | None:
        if self.architecture not in PERMUTED_ARCHITECTURES:
            return None
        return {"q_proj": self.num_heads, "k_proj": self.num_kv_heads}.get(name.split(".")[-2])


PARAM_NAMES = {"int4": ("qweight", "scales", "zeros"), "int8": ("qweight", "scales")}


def hf_rows(values: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a Llama Q or K weight (or of its codes, scales or zeros) from llama.cpp's order back to Hugging
    Face's: in each head, rows 2i and 2i + 1 go to i and i + head_dim / 2."""
    half = values.shape[0] // num_heads // 2
    return values.reshape(num_heads, half, 2, *values.shape[1:]).transpose(1, 2).reshape(values.shape).contiguous()


def method_kind(type_name: str) -> str | None:
    """"int4", "int8" or None (dequantized) for a GGML type's name."""
    return "int4" if type_name in INT4_BLOCK_TYPES else "int8" if type_name in INT8_BLOCK_TYPES else None


def use_gguf_methods(model: nn.Module, gguf_path: Path, num_heads: int, num_kv_heads: int) -> GgufWeights:
    """Before loading: give each linear layer whose GGUF tensors are all of one kept kind its int4 or int8
    method. Returns what replaces the converted directory's tensors when loading (``GgufWeights.stream``)."""
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
    layers = {"int4": 0, "int8": 0, "dequantized": 0}

    def choose(name: str, layer: nn.Module):
        sources = {}
        for checkpoint_name in layer.weight_targets(name):
            if checkpoint_name.endswith(".weight"):
                gguf_name = name_map.get_name(checkpoint_name, try_suffixes=(".weight",))  # blk.0.attn_q.weight
                tensor = by_name.get(gguf_name) if gguf_name else None
                sources[checkpoint_name] = tensor
        kinds = {None if t is None else method_kind(t.tensor_type.name) for t in sources.values()}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind is None:
            layers["dequantized"] += 1
            return None
        layers[kind] += 1
        found.tensors.update({n: (t, kind) for n, t in sources.items()})
        return Int4LinearMethod(GGUF_BLOCK, FLOAT32_IN_BFLOAT16) if kind == "int4" else Int8LinearMethod(GGUF_BLOCK)

    set_linear_methods(model, choose)
    found.layers = layers
    return found


def log_weight_bytes(model: nn.Module, found: GgufWeights) -> None:
    """At start-up: how many linear layers are kept in each format, and the bytes of their codes and scales
    against what their dequantized weights take in the compute dtype (and the copies dequantized for the product
    where no int4 or int8 op serves the device and dtype)."""
    kept = dequantized = copies = with_copy = 0
    for _, layer in linear_layers(model):
        if isinstance(layer.method, (Int4LinearMethod, Int8LinearMethod)):
            names = PARAM_NAMES["int4" if isinstance(layer.method, Int4LinearMethod) else "int8"]
            kept += sum(getattr(layer, n).numel() * getattr(layer, n).element_size() for n in names)
            dequantized += layer.out_features * layer.in_features * layer.scales.element_size()
            copy = getattr(layer, "dequantized_weight", None)
            if copy is not None:
                copies += copy.numel() * copy.element_size()
                with_copy += 1
    counts = found.layers
    logger.info("GGUF linear layers: %d kept in int4 (Q4_0/Q4_1), %d in int8 (Q8_0), %d dequantized; the kept "
                "layers' codes and scales take %.1f MiB, dequantized they would take %.1f MiB%s "
                "(--quantization none dequantizes every layer)",
                counts["int4"], counts["int8"], counts["dequantized"], kept / 2**20, dequantized / 2**20,
                f" ({with_copy} of them hold a dequantized copy for the product, {copies / 2**20:.1f} MiB)"
                if with_copy else "")
