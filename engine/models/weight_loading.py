"""Filling a model from a checkpoint: each Hugging Face tensor name to the parameter (or part of one) it fills.

A module that lays its checkpoint tensors out its own way gives ``weight_targets(prefix)``: checkpoint name ->
loader. The linear layers do (``LinearBase``: q|k|v parts, tensor-parallel shards, each weight method's
parameters), and so do the fused experts. Other parameters are filled whole, or, under tensor parallelism, by
the span their ``source_range`` names (the embedding's and the LM head's vocabulary rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import tp_size


def take(tensor, dim: int, span: tuple[int, int] | None) -> torch.Tensor:
    """``tensor`` (a torch tensor or a lazily read checkpoint tensor) narrowed to ``span`` = (start, length)
    along ``dim``; only that part is read from the checkpoint."""
    if span is None:
        return tensor if isinstance(tensor, torch.Tensor) else tensor.load()
    return tensor.narrow(dim, *span)


@torch.no_grad()
def copy_weight(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into a parameter (any device/dtype), insisting on the exact shape."""
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch for {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)


@dataclass
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, or a module's own loader for it."""

    param: nn.Parameter | None
    loader: Callable[[str, object], None] | None = None  # loader(name, tensor), from ``weight_targets``

    def load(self, name: str, tensor) -> None:
        if self.loader is not None:
            self.loader(name, tensor)
            return
        sharded = getattr(self.param, "source_range", None)  # (dim, start, length) under tensor parallelism
        dim, span = (sharded[0], sharded[1:]) if sharded is not None and tp_size() > 1 else (0, None)
        copy_weight(self.param.data, take(tensor, dim, span), name)


def checkpoint_targets(model: nn.Module) -> dict[str, WeightTarget]:
    """Map each Hugging Face tensor name the model needs to where it goes.

    Parameter names mirror Hugging Face's, except that a fused linear ``x.qkv_proj.weight`` is filled from
    ``x.q_proj.weight``, ``x.k_proj.weight`` and ``x.v_proj.weight`` (its ``weight_targets``). Tied parameters
    appear once, under their first name.
    """
    targets: dict[str, WeightTarget] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if hasattr(module, "weight_targets"):  # a module that lays several checkpoint tensors out its own way
            for name, loader in module.weight_targets(module_name).items():
                targets[name] = WeightTarget(None, loader)
            seen.update(id(p) for p in module.parameters(recurse=False))
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            targets[f"{module_name}.{param_name}" if module_name else param_name] = WeightTarget(param)
    return targets


def load_checkpoint_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], skip: set[str] | None = None
) -> set[str]:
    """Copy Hugging Face-named tensors into ``model``; return the names loaded.

    Names in ``skip`` and rotary ``inv_freq`` buffers are ignored. An unknown name, or
    a needed tensor that never arrives, raises ValueError naming it.
    """
    targets = checkpoint_targets(model)
    skip = skip or set()
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in skip or name.endswith("rotary_emb.inv_freq"):
            continue
        target = targets.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        target.load(name, tensor)
        loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for {type(model).__name__}: {shown}")
    return loaded
