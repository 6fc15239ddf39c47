"""The linear layers of the decoders: y = x W^T (+ b), W split over the tensor-parallel ranks, held and multiplied
by a weight method (``engine.models.linear.method``).

    FusedLinear        one product for several projections of the same input (q|k|v, gate|up); with tensor
                       parallelism each rank holds some rows of every projection (column parallel)
    RowParallelLinear  o_proj, down_proj: each rank holds some input columns, one all-reduce sums the ranks'
                       products, the bias is added once after it

``forward(x)`` is the product. ``forward_deferred(x)`` is the same product as a ``LinearOutput`` whose last
elementwise step may be left to the kernel that reads it next (FP8 column scales, partial products of K's
slices), for a model whose next kernel does it (the Llama decoder's add-norms, SwiGLU and KV-cache write).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from engine.distributed import all_reduce, shard_range, tp_size
from engine.models.linear.method import LinearMethod, WeightLayout, WeightPart
from engine.models.linear.output import LinearOutput
from engine.models.linear.unquantized import UnquantizedLinearMethod


class LinearBase(nn.Module):
    """W [out_features, in_features] as this rank holds it, and its method (``UnquantizedLinearMethod`` until the
    loader sets another). ``parts``: where each checkpoint tensor lands in W, by the name of the projection it is
    (None: the layer's own name); ``input_shard``: the checkpoint columns this rank holds, None where it holds all.
    ``param_layouts``: each parameter's ``WeightLayout``; the bias is the layer's, the others its method's."""

    takes_fp8_input = False  # whether forward takes an Fp8Activation; set by process_after_loading
    input_shard: tuple[int, int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, parts: dict[str | None, WeightPart]):
        super().__init__()
        self.in_features, self.out_features, self.parts = in_features, out_features, parts
        self.param_layouts: dict[str, WeightLayout] = {}
        self.method: LinearMethod = UnquantizedLinearMethod()
        self.method.create_weights(self, torch.get_default_dtype())
        if bias:
            self.add_param("bias", (out_features,), torch.get_default_dtype(), WeightLayout(0, None))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in_features] -> [num_tokens, out_features]
        return self.method.apply(self, x, self.bias)

    def forward_deferred(self, x: torch.Tensor, partials_ok: bool = True) -> LinearOutput:
        """The product as a ``LinearOutput``, its last step left to the kernel that reads it where the method
        leaves it; ``partials_ok``: that kernel adds partial products (the KV-cache write only with a 16-bit
        cache)."""
        return self.method.apply_deferred(self, x, partials_ok)

    # ------------------------------------------------------------------ the method's parameters

    def set_method(self, method: LinearMethod) -> None:
        """Hold and multiply W by ``method`` from now on (before loading): its parameters replace the old
        method's; one of the same name, shape and dtype is kept as it is, values included."""
        old = [name for name in self.param_layouts if name != "bias"]
        self.param_layouts = {name: layout for name, layout in self.param_layouts.items() if name == "bias"}
        self.method = method
        method.create_weights(self, self._compute_dtype())
        for name in old:
            if name not in self.param_layouts:
                delattr(self, name)

    def add_param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, layout: WeightLayout) -> None:
        """Register an (uninitialised) parameter for the checkpoint to fill, unless one of that shape and dtype is
        there already."""
        param = self._parameters.get(name)
        if param is None or tuple(param.shape) != tuple(shape) or param.dtype != dtype:
            device = next((p.device for p in self.parameters(recurse=False)), None)  # None: the default device
            param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        self.set_param(name, param, layout)

    def set_param(self, name: str, tensor: torch.Tensor, layout: WeightLayout) -> None:
        """Register ``tensor`` as parameter ``name`` (a method's own, e.g. a weight it quantized)."""
        self.register_parameter(name, tensor if isinstance(tensor, nn.Parameter)
                                else nn.Parameter(tensor, requires_grad=False))
        self.param_layouts[name] = layout

    def _compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes in: its weight's while that is 16 or 32 bits, else the default."""
        weight = self._parameters.get("weight")
        if weight is not None and weight.is_floating_point() and weight.element_size() > 1:
            return weight.dtype
        return torch.get_default_dtype()

    # ------------------------------------------------------------------ loading

    def weight_targets(self, prefix: str) -> dict[str, Callable[[str, object], None]]:
        """Checkpoint name -> loader, for every part of W and every parameter: ``x.q_proj.weight`` fills the q
        rows of ``x.qkv_proj``; a plain layer's tensors are named after it."""
        parent = prefix.rpartition(".")[0]
        targets = {}
        for shard, part in self.parts.items():
            base = prefix if shard is None else f"{parent}.{shard}" if parent else shard
            for name in self.param_layouts:
                targets[f"{base}.{name}"] = self._loader(name, part)
        return targets

    def _loader(self, param_name: str, part: WeightPart) -> Callable[[str, object], None]:
        def load(checkpoint_name: str, tensor) -> None:
            self.method.load_weight(self, param_name, tensor, part, checkpoint_name)

        return load

    def process_after_loading(self) -> None:
        """Once, after loading: the method's processing, and what the model's kernels read per step."""
        self.method.process_after_loading(self)
        self.takes_fp8_input = self.method.takes_fp8_input(self)


class FusedLinear(LinearBase):
    """One matmul for several projections of the same input, e.g. q|k|v or gate|up.

    The output rows are the shards in order (``shard_slices``). Checkpoints store each shard as its own tensor
    (``q_proj``, ``k_proj``, ...), which fills its rows. With tensor parallelism each rank holds some rows of
    every shard (a column-parallel linear): ``source_rows`` gives, per shard, the (first row, count) of the
    checkpoint tensor this rank loads.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool,
                 source_rows: dict[str, tuple[int, int]] | None = None):
        self.shard_slices: dict[str, slice] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_slices[name] = slice(offset, offset + size)
            offset += size
        source_rows = source_rows or {}
        parts = {name: WeightPart(rows, source_rows.get(name)) for name, rows in self.shard_slices.items()}
        super().__init__(in_features, offset, bias, parts)


class RowParallelLinear(LinearBase):
    """A linear whose input features are split over the tensor-parallel ranks (o_proj, down_proj): each rank
    multiplies its slice, one all-reduce sums them, the bias is added once after it. Its ``forward_deferred``
    leaves nothing to the next kernel on several ranks: the ranks' products are summed whole."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        start, local = shard_range(in_features)
        shard = (start, local) if tp_size() > 1 else None
        super().__init__(local, out_features, bias, {None: WeightPart(source_cols=shard)})
        self.input_shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_shard is None:
            return self.method.apply(self, x, self.bias)
        out = all_reduce(self.method.apply(self, x, None))
        return out if self.bias is None else out + self.bias

    def forward_deferred(self, x: torch.Tensor, partials_ok: bool = True) -> LinearOutput:
        if self.input_shard is None:
            return self.method.apply_deferred(self, x, partials_ok)
        return LinearOutput(self.forward(x))


def linear_layers(model: nn.Module) -> Iterator[tuple[str, LinearBase]]:
    """(qualified name, layer) of every linear layer with a weight method."""
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            yield name, module


def set_linear_methods(model: nn.Module, choose: Callable[[str, LinearBase], LinearMethod | None]) -> int:
    """Before loading: give each linear layer the method ``choose(name, layer)`` returns (None: keep its own).
    Returns how many layers got one."""
    count = 0
    for name, layer in linear_layers(model):
        method = choose(name, layer)
        if method is None:
            continue
        try:
            layer.set_method(method)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        count += 1
    return count


def process_weights_after_loading(model: nn.Module) -> None:
    """After loading: each linear layer's method quantizes, derives and checks what it needs, once."""
    for name, layer in linear_layers(model):
        try:
            layer.process_after_loading()
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
