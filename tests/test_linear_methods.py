"""The weight-method seam of the linear layers (``engine.models.linear``): parameters by method, checkpoint parts
landing by layout, methods swapped before loading, and a method wrapping another (as a LoRA adapter would)."""

from __future__ import annotations

import pytest
import torch

from engine import distributed
from engine.models.linear import (
    Fp8LinearMethod,
    FusedLinear,
    LinearMethod,
    RowParallelLinear,
    UnquantizedLinearMethod,
    WeightLayout,
    process_weights_after_loading,
)
from engine.models.weight_loading import load_checkpoint_weights


class BlockScaled(LinearMethod):
    """A toy method whose second parameter has one value per 4 rows and 8 columns of W (as block or group scales
    do): what lands where is decided by its WeightLayout alone."""

    def create_weights(self, layer, dtype):
        layer.add_param("weight", (layer.out_features, layer.in_features), dtype, WeightLayout())
        layer.add_param("scales", (layer.out_features // 4, layer.in_features // 8), dtype, WeightLayout(0, 1, 4, 8))

    def apply(self, layer, x, bias):
        return torch.nn.functional.linear(x, layer.weight, bias)


class Adapter(LinearMethod):
    """A toy wrapper in the shape of a LoRA adapter: the base method's parameters and product, plus x A^T B^T."""

    def __init__(self, base: LinearMethod, rank: int):
        self.base, self.rank = base, rank

    def create_weights(self, layer, dtype):
        self.base.create_weights(layer, dtype)
        layer.add_param("lora_a", (self.rank, layer.in_features), dtype, WeightLayout(None, 1))
        layer.add_param("lora_b", (layer.out_features, self.rank), dtype, WeightLayout(0, None))

    def process_after_loading(self, layer):
        self.base.process_after_loading(layer)

    def apply(self, layer, x, bias):
        return self.base.apply(layer, x, bias) + (x @ layer.lora_a.T) @ layer.lora_b.T


def test_checkpoint_parts_land_by_the_parameters_layouts(monkeypatch):
    """q|k|v parts and tensor-parallel shards land in every parameter in its own units: a rank of two holding rows
    8-15 of each projection takes blocks 2-3 of the scales' rows; a row-parallel rank columns 16-31, block 2-3."""
    monkeypatch.setattr(distributed, "_state", distributed.ParallelState(rank=1, world_size=2))
    qkv = FusedLinear(32, {"q_proj": 8, "k_proj": 8}, bias=True, source_rows={"q_proj": (8, 8), "k_proj": (8, 8)})
    qkv.set_method(BlockScaled())
    down = RowParallelLinear(32, 8, bias=True)
    down.set_method(BlockScaled())
    model = torch.nn.ModuleDict({"qkv_proj": qkv, "down_proj": down})
    full = {f"{p}.{n}": torch.arange(torch.Size(s).numel(), dtype=torch.float32).view(s)
            for p, shapes in (("q_proj", {"weight": (16, 32), "scales": (4, 4), "bias": (16,)}),
                              ("k_proj", {"weight": (16, 32), "scales": (4, 4), "bias": (16,)}),
                              ("down_proj", {"weight": (8, 32), "scales": (2, 4), "bias": (8,)}))
            for n, s in shapes.items()}
    assert load_checkpoint_weights(model, full.items()) == set(full)
    assert torch.equal(qkv.weight, torch.cat([full["q_proj.weight"][8:], full["k_proj.weight"][8:]]))
    assert torch.equal(qkv.scales, torch.cat([full["q_proj.scales"][2:], full["k_proj.scales"][2:]]))
    assert torch.equal(qkv.bias, torch.cat([full["q_proj.bias"][8:], full["k_proj.bias"][8:]]))
    assert torch.equal(down.weight, full["down_proj.weight"][:, 16:])
    assert torch.equal(down.scales, full["down_proj.scales"][:, 2:])
    assert torch.equal(down.bias, full["down_proj.bias"])  # added once, after the all-reduce: whole


def test_a_method_set_before_loading_keeps_what_it_shares_and_drops_the_rest():
    layer = RowParallelLinear(256, 128, bias=False)
    torch.nn.init.normal_(layer.weight)
    weight = layer.weight
    layer.set_method(Fp8LinearMethod())  # --quantization fp8: the weight loads in the model dtype, as before
    assert layer.weight is weight and not hasattr(layer, "weight_scale_inv")
    process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (128,)
    layer.set_method(Fp8LinearMethod((128, 128)))  # an FP8 checkpoint: FP8 weight and one scale per tile
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (1, 2)
    layer.set_method(UnquantizedLinearMethod())
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_scale_inv")
    assert [name for name, _ in layer.named_parameters()] == ["weight"]


def test_a_method_can_wrap_the_layers_method():
    """An adapter wraps the layer's method: the base weight stays as it was, the adapter's tensors are named in the
    checkpoint after the layer, and forward adds the adapter's product."""
    gen = torch.Generator().manual_seed(0)
    down = RowParallelLinear(16, 8, bias=False)
    down.weight.data.copy_(torch.randn(8, 16, generator=gen))
    before = down.weight.clone()
    down.set_method(Adapter(down.method, rank=2))
    a, b = torch.randn(2, 16, generator=gen), torch.randn(8, 2, generator=gen)
    model = torch.nn.ModuleDict({"down_proj": down})
    tensors = {"down_proj.weight": before, "down_proj.lora_a": a, "down_proj.lora_b": b}
    load_checkpoint_weights(model, tensors.items())
    process_weights_after_loading(model)
    x = torch.randn(3, 16, generator=gen)
    torch.testing.assert_close(down(x), x @ before.T + x @ a.T @ b.T)
    assert torch.equal(down.forward_deferred(x).finished(), down(x))
    with pytest.raises(ValueError, match="shape mismatch for down_proj.lora_b"):
        load_checkpoint_weights(model, [*tensors.items(), ("down_proj.lora_b", b.T)])
