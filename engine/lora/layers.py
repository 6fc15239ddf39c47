"""LoRA on the linear layers: every layer's weight method wrapped so that each token adds its adapter's product.

A layer serving adapters holds ``max_loras`` slots of them, stacked (device buffers, not checkpoint parameters):

    lora_a  [slots, slices * max_rank, in_features]    each slice's A in its own band of rows
    lora_b  [slots, out_features, slices * max_rank]   each slice's B (times its scaling) in its rows of W and its
                                                       band of columns: zero elsewhere

A plain layer (o_proj, down_proj) has one slice; a fused one (q|k|v, gate|up) one per projection, so that one
shrink (x A^T, [tokens, slices * rank]) and one expand (h B^T) serve all its projections: B's zero blocks keep each
projection's rows to its own A. A rank below ``max_rank`` is zero-padded. Under tensor parallelism the layer's
share of W decides the adapter's share, as vLLM splits them: a column-parallel layer (q|k|v, gate|up) holds every
column of A and its rows of B, a row-parallel one (o, down) its columns of A and all of B; the row-parallel
product ``(x_r A_r^T) B^T`` of each rank is summed by the all-reduce that sums the base layer's, so neither needs
a collective of its own.

Which slot each token reads is the step's (``LoRAMapping``, filled by the model runner before the forward pass and
read by every layer): per token (``token_slots``, -1 for none) and grouped by slot (``token_order``,
``slot_starts``). Its tensors never move, so a captured CUDA graph replays each step's mapping; the kernels
(``engine.ops.lora``) take their grid from shapes alone and skip tokens of no adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.fused_path import runs_triton
from engine.models.linear.layer import FusedLinear, LinearBase, linear_layers
from engine.models.linear.method import LinearMethod
from engine.models.linear.output import LinearOutput
from engine.ops.lora_reference import lora_expand_reference, lora_shrink_reference

# Steps of at most this many tokens read each token's slot (BGMV); larger ones go slot by slot (SGMV).
BGMV_MAX_TOKENS = 16


@dataclass
class LoRAMapping:
    """Which slot each of the step's tokens reads, on the device (fixed buffers, rewritten every step)."""

    token_slots: torch.Tensor  # [max tokens] int32, -1: no adapter
    token_order: torch.Tensor  # [max tokens] int32: token indices grouped by slot
    slot_starts: torch.Tensor  # [max_loras + 1] int32: slot s's tokens are token_order[slot_starts[s]:...[s + 1]]
    # This step, on the host: whether any token has an adapter (False: the layers skip their products). A CUDA
    # graph is captured with ``active`` on.
    active: bool = False
    use_triton: bool | None = None  # as the fused modules' (engine.models.fused_path): None by device

    def add_products(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """y += (x A[slot]^T) B[slot]^T for each token under an adapter, in place."""
        num_tokens = x.shape[0]
        h = torch.empty(num_tokens, a.shape[1], dtype=torch.float32, device=x.device)
        slots = self.token_slots[:num_tokens]
        if not runs_triton(self.use_triton, x):
            lora_shrink_reference(x, a, slots, h)
            lora_expand_reference(h, b, slots, y)
            return
        from engine.ops import lora as ops

        if num_tokens <= BGMV_MAX_TOKENS:
            ops.lora_shrink_bgmv(x, a, slots, h)
            ops.lora_expand_bgmv(h, b, slots, y)
        else:
            ops.lora_shrink(x, a, self.token_order, self.slot_starts, h)
            ops.lora_expand(h, b, self.token_order, self.slot_starts, y)


class LoRALinearMethod(LinearMethod):
    """A layer's method with adapters on top: the base method's product, plus each token's adapter's. The base
    method keeps its parameters and its processing; the product is always whole (``apply_deferred`` leaves nothing
    to the next kernel, and the input is read in the model dtype, never as FP8)."""

    def __init__(self, base: LinearMethod, mapping: LoRAMapping):
        self.base = base
        self.mapping = mapping

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        self.base.create_weights(layer, dtype)

    def load_weight(self, layer, param_name, tensor, part, what) -> None:
        self.base.load_weight(layer, param_name, tensor, part, what)

    def process_after_loading(self, layer: nn.Module) -> None:
        self.base.process_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)
        if self.mapping.active:
            self.mapping.add_products(y, x, layer.lora_a, layer.lora_b)
        return y

    def apply_deferred(self, layer: nn.Module, x: torch.Tensor, partials_ok: bool = True) -> LinearOutput:
        return LinearOutput(self.apply(layer, x, layer.bias))


@dataclass
class LoRALayer:
    """One linear layer serving adapters: its slices, each the checkpoint module that fills it, where its product
    goes in W's rows, and which rows of B (column-parallel) or columns of A (row-parallel) this rank holds."""

    layer: LinearBase
    modules: list[str]  # the checkpoint module of each slice, e.g. model.layers.0.self_attn.k_proj
    rows: list[slice]  # each slice's rows of this rank's W
    source_rows: list[tuple[int, int] | None]  # each slice's (first, count) of B's rows this rank holds
    source_cols: tuple[int, int] | None  # (first, count) of A's columns this rank holds; None: all

    def install(self, slot: int, adapter: dict[str, tuple[torch.Tensor, torch.Tensor]], max_rank: int) -> None:
        """Copy an adapter's A and B for this layer into ``slot`` (zeros for the slices it does not adapt)."""
        a, b = self.layer.lora_a[slot], self.layer.lora_b[slot]
        a.zero_()
        b.zero_()
        for i, module in enumerate(self.modules):
            if module not in adapter:
                continue
            lora_a, lora_b = adapter[module]
            rank = lora_a.shape[0]
            if self.source_cols is not None:
                lora_a = lora_a.narrow(1, *self.source_cols)
            if self.source_rows[i] is not None:
                lora_b = lora_b.narrow(0, *self.source_rows[i])
            band = slice(i * max_rank, i * max_rank + rank)
            a[band].copy_(lora_a, non_blocking=True)
            b[self.rows[i], band].copy_(lora_b, non_blocking=True)


def attach_lora(model: nn.Module, mapping: LoRAMapping, max_loras: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, LoRALayer]:
    """Wrap every linear layer's method (after loading) and give it ``max_loras`` empty slots of ``dtype`` (the
    compute dtype). Returns the layers by checkpoint module name (each slice of a fused layer under its
    projection's name)."""
    by_module: dict[str, LoRALayer] = {}
    for name, layer in linear_layers(model):
        parent = name.rpartition(".")[0]
        if isinstance(layer, FusedLinear):
            shards = list(layer.shard_slices)
            modules = [f"{parent}.{s}" if parent else s for s in shards]
            rows = [layer.shard_slices[s] for s in shards]
            source_rows = [layer.parts[s].source_rows for s in shards]
        else:
            modules, rows, source_rows = [name], [slice(0, layer.out_features)], [None]
        width = len(modules) * max_rank
        layer.register_buffer("lora_a", torch.zeros(max_loras, width, layer.in_features, dtype=dtype,
                                                    device=device), persistent=False)
        layer.register_buffer("lora_b", torch.zeros(max_loras, layer.out_features, width, dtype=dtype,
                                                    device=device), persistent=False)
        layer.method = LoRALinearMethod(layer.method, mapping)
        layer.takes_fp8_input = False
        entry = LoRALayer(layer, modules, rows, source_rows, layer.input_shard)
        for module in modules:
            by_module[module] = entry
    return by_module
