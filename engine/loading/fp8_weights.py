"""FP8 weights at load time: which linear layers go FP8, quantizing a model's weights in place
(``--quantization fp8``), and giving the layers an FP8 checkpoint's parameters before it is read."""

from __future__ import annotations

import torch

from engine.distributed import max_over_ranks_, tp_size
from engine.models.fp8 import Fp8Scheme, blocks, quantize_per_channel
from engine.models.layers import FusedLinear, RowParallelLinear
from kvcache.paged_cache import FP8_DTYPE


def check_block_alignment(what: str, sizes: dict[str, int], block: int) -> None:
    """Block scales can be split (tensor parallelism) or concatenated (q|k|v) only on tile boundaries."""
    for name, size in sizes.items():
        if size % block:
            raise ValueError(f"{what}: {name} has {size} rows/columns, not a multiple of the FP8 weight block "
                             f"({block}); this split of a block-quantized checkpoint is not supported")


def quantizable_linears(model: torch.nn.Module, skip: tuple[str, ...] = ()):
    """(name, module) of the linear layers that go FP8: the attention and MLP projections. Embeddings, norms, the
    LM head, routers and fused experts stay in the compute dtype."""
    for name, module in model.named_modules():
        if isinstance(module, (FusedLinear, RowParallelLinear)) and not any(s and s in name for s in skip):
            yield name, module


@torch.no_grad()
def quantize_model_weights(model: torch.nn.Module) -> int:
    """``--quantization fp8``: replace each quantizable linear's weight by FP8 and per-channel scales (in place,
    one layer at a time, so the peak stays at the unquantized model). Returns how many layers changed."""
    count = 0
    for _, module in quantizable_linears(model):
        weight, amax = module.weight.data, None
        if isinstance(module, RowParallelLinear) and tp_size() > 1:
            # Each rank holds some of every output channel's input columns: the channel's scale comes from all of
            # them (a maximum over the ranks), so the weights round as on one GPU and every rank's partial product
            # has the same channel scales.
            amax = max_over_ranks_(weight.float().abs().amax(dim=1))
        module.set_fp8_weight(*quantize_per_channel(weight, amax), None)
        count += 1
    return count


@torch.no_grad()
def prepare_fp8_checkpoint(model: torch.nn.Module, scheme: Fp8Scheme) -> int:
    """Give each quantizable linear FP8 parameters in the checkpoint's layout (before loading), so that its
    FP8 tensors and ``weight_scale_inv`` scales are copied in as stored. Returns how many layers changed."""
    if scheme.block is None:
        raise ValueError("FP8 checkpoints without weight_block_size (one scale per tensor) are not supported")
    bn, bk = scheme.block
    count = 0
    for name, module in quantizable_linears(model, scheme.modules_to_not_convert):
        out_features, in_features = module.weight.shape
        if hasattr(module, "shard_slices"):  # q|k|v or gate|up: each part starts on a tile boundary
            check_block_alignment(name, {s: sl.stop - sl.start for s, sl in module.shard_slices.items()}, bn)
            check_block_alignment(name, {f"{s} (first row)": r[0] for s, r in module.source_rows.items()}, bn)
        source = getattr(module.weight, "source_range", None)
        if source is not None and tp_size() > 1:  # a row-parallel rank's columns start on a tile boundary
            check_block_alignment(name, {"this rank's first column": source[1], "its columns": source[2]}, bk)
        weight = torch.empty((out_features, in_features), dtype=FP8_DTYPE, device=module.weight.device)
        scales = torch.empty((blocks(out_features, bn), blocks(in_features, bk)), dtype=torch.float32,
                             device=module.weight.device)
        module.set_fp8_weight(weight, scales, scheme.block)
        count += 1
    return count


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (FP8 weights and their scales counted as stored)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
