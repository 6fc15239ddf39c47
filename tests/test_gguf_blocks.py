"""GGUF's blocks as the int4 and int8 methods hold them (``engine.loading.gguf_blocks`` and ``gguf_kquants``, and
the form ``engine.loading.gguf_weights`` picks for a layer of several parts), and int8 weights with zero points
(``engine.models.linear.int8``).

Blocks are random bytes but for their float16 scales, chosen as quantizers make them, so that every code, high bit
and sub-block scale and min is met; the types ``gguf`` quantizes are also met as it quantizes weights with blocks
quantizers treat specially. The reference is ``gguf.quants.dequantize`` of the same bytes: in float32, the codes,
scales and zeros dequantized by our methods equal it exactly, and a layer's product is x times it.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine import distributed
from engine.loading import gguf_weights
from engine.loading.gguf_weights import KEPT_TYPES, Held
from engine.models.linear import (
    FusedLinear,
    Int8LinearMethod,
    RowParallelLinear,
    WeightLayout,
    dequantize_int4,
    dequantize_int8,
    int8,
    process_weights_after_loading,
)
from engine.models.weight_loading import load_checkpoint_weights
from tests.test_int4_linear import HAS_INT4_OP, HAS_INT8_OP, assert_product, load

KEPT = sorted(KEPT_TYPES)
QUANTIZED_BY_GGUF = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # the kept types ``gguf`` can quantize
# The float16 fields of each type's block, by byte offset: "d" a scale, "m" a minimum, "dmin" the mins' scale.
FLOAT16_FIELDS = {"Q4_0": {0: "d"}, "Q4_1": {0: "d", 2: "m"}, "Q5_0": {0: "d"}, "Q5_1": {0: "d", 2: "m"},
                  "Q8_0": {0: "d"}, "Q4_K": {0: "d", 2: "dmin"}, "Q5_K": {0: "d", 2: "dmin"}, "Q6_K": {208: "d"},
                  "Q3_K": {108: "d"}}


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of ``name`` blocks: random bytes, but for float16 scales d of either sign (positive for
    the K-quants with mins), minimums m about -8 d (Q4_1) or -16 d (Q5_1) and mins' scales dmin about 8 d."""
    qtype = gguf.GGMLQuantizationType[name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    count = rows * cols // block_values
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, count) * (1 if name in ("Q4_K", "Q5_K") else rng.choice([-1, 1], count))
    values = {"d": d, "m": -np.abs(d) * rng.uniform(4, 12 if name == "Q4_1" else 24, count),
              "dmin": d * rng.uniform(4, 16, count)}
    for offset, field in FLOAT16_FIELDS[name].items():
        blocks[:, offset:offset + 2] = values[field].astype(np.float16).view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, -1)


def dequantized(data: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name]))


def special_weights(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random float32 weights with the blocks quantizers treat specially: all zeros, one value, one sign."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w[0, :32], w[1, 32:64], w[2, :32] = 0, 0.5, np.abs(w[2, :32])
    return w


def assert_forms_exact(data: np.ndarray, name: str) -> None:
    """The type's int8 form, and its int4 form where it has one, dequantize to exactly ``gguf``'s weights."""
    rows, cols = dequantized(data, name).shape
    block_type = KEPT_TYPES[name]
    codes, scales, zeros = block_type.int8(data)
    groups = (rows, cols // block_type.group)
    assert (codes.dtype, tuple(codes.shape), scales.dtype, tuple(scales.shape)) == (
        torch.int8, (rows, cols), torch.float32, groups)
    assert (zeros is not None) == block_type.zeros and (zeros is None or tuple(zeros.shape) == groups)
    assert torch.equal(dequantize_int8(codes, scales, zeros), dequantized(data, name))
    if block_type.int4 is not None:
        qweight, scales, zeros = block_type.int4(data)
        assert (qweight.dtype, tuple(qweight.shape), tuple(scales.shape), tuple(zeros.shape)) == (
            torch.uint8, (rows, cols // 2), (rows, cols // 32), (rows, cols // 32))
        assert torch.equal(dequantize_int4(qweight, scales, zeros, 32), dequantized(data, name))


@pytest.mark.parametrize("name", KEPT)
def test_random_blocks_convert_to_exactly_the_weights_gguf_dequantizes(name):
    data = random_blocks(name, 8, 512, np.random.default_rng(len(name) + ord(name[1])))
    assert_forms_exact(data, name)
    block_type = KEPT_TYPES[name]
    for convert in filter(None, (block_type.int8, block_type.int4)):
        stacked = convert(np.stack([data, data]))  # leading dims (experts) are kept
        assert all(t is None or t.shape[:2] == (2, 8) for t in stacked)
        with pytest.raises(ValueError, match=f"{name} data must be uint8 with rows of whole"):
            convert(data[:, :-1])


@pytest.mark.parametrize("name", QUANTIZED_BY_GGUF)
def test_weights_gguf_quantizes_convert_exactly(name):
    blocks = gguf.quants.quantize(special_weights(16, 256, 5), gguf.GGMLQuantizationType[name])
    assert_forms_exact(blocks, name)
    if name == "Q4_0":
        assert not KEPT_TYPES[name].int4(blocks)[2].any()  # Q4_0's zeros are 0


def test_the_form_of_a_layer_follows_its_parts_types():
    """All 4-bit types: int4 in groups of 32; any other kept type: int8 at the finest group of the parts (Q6_K's
    16), with zeros where a part has them; a part of a type that is not kept, or missing, leaves it dequantized."""
    assert Held.of(["Q4_0", "Q4_1", "Q4_K"]) == Held("int4", 32, True)
    assert Held.of(["Q6_K"]) == Held("int8", 16, False)
    assert Held.of(["Q8_0", "Q5_0"]) == Held("int8", 32, False)
    assert Held.of(["Q8_0", "Q5_1"]) == Held("int8", 32, True)
    assert Held.of(["Q4_K", "Q4_K", "Q6_K"]) == Held("int8", 16, True)
    for type_names in (["Q4_K", "Q3_K"], ["F16"], ["Q4_0", None], []):
        assert Held.of(type_names) is None


@pytest.mark.parametrize("name", KEPT)
def test_every_kept_type_is_exact_in_a_mixed_layers_form(name):
    """Re-expressed at group 16 with zeros (a Q4_K|Q6_K layer's form), and without zeros where the type has none:
    the scales and zeros repeated per finer group, zeros of 0 added, the weights still exactly gguf's."""
    data = random_blocks(name, 4, 256, np.random.default_rng(ord(name[1])))
    for held in (Held("int8", 16, True), Held("int8", 16, False)):
        if held.zeros or not KEPT_TYPES[name].zeros:
            parts = held.convert(data, name)
            assert len(parts) == len(held.param_names()) and tuple(parts[1].shape) == (4, 16)
            assert torch.equal(dequantize_int8(*parts), dequantized(data, name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", KEPT)
def test_a_gguf_weight_served_quantized_multiplies_as_gguf_dequantizes_it(monkeypatch, name, dtype):
    """A GGUF tensor's blocks, converted and loaded into a layer of the method for its type: the product is x
    times the weight gguf dequantizes (through the CPU int4 op in a bfloat16 layer where this torch has it)."""
    monkeypatch.setattr(gguf_weights, "FLOAT32_IN_BFLOAT16", False)
    data = random_blocks(name, 32, 256, np.random.default_rng(7))
    held = Held.of([name])
    layer = RowParallelLinear(256, 32, bias=False).to(dtype)
    layer.set_method(held.method())
    load(layer, dict(zip(held.param_names(), held.convert(data, name))))
    assert (getattr(layer, "int4_packed", None) is not None) == (HAS_INT4_OP and held.kind == "int4"
                                                                 and dtype == torch.bfloat16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8)).to(dtype)
    assert_product(layer(x), x, dequantized(data, name), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_q4_k_q6_k_fused_layer_holds_each_part_exactly_in_int8(dtype):
    """q|k in Q4_K and v in Q6_K, as Q4_K_M files hold some layers: one int8 layer of group 16 with zeros, its
    rows each part's weights as gguf dequantizes them (exactly, in float32), its product x times them."""
    rng = np.random.default_rng(9)
    types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K"}
    rows = {"q_proj": 64, "k_proj": 32, "v_proj": 32}
    blocks = {part: random_blocks(name, rows[part], 256, rng) for part, name in types.items()}
    held = Held.of(list(types.values()))
    layer = FusedLinear(256, rows, bias=False).to(dtype)
    layer.set_method(held.method())
    assert isinstance(layer.method, Int8LinearMethod) and (layer.method.group_size, layer.method.zeros) == (16, True)
    tensors = {f"{part}.{param}": value for part, name in types.items()
               for param, value in zip(held.param_names(), held.convert(blocks[part], name))}
    model = torch.nn.ModuleDict({"qkv_proj": layer})
    assert load_checkpoint_weights(model, list(tensors.items())) == set(tensors)
    process_weights_after_loading(model)
    weight = torch.cat([dequantized(blocks[part], name) for part, name in types.items()])
    if dtype == torch.float32:
        assert torch.equal(layer.dequantized_weight, weight)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(10)).to(dtype)
    assert_product(layer(x), x, weight, None)


def random_int8(rows: int, cols: int, group_size: int | None, gen: torch.Generator):
    """Codes [rows, cols] int8, and float32 scales and zeros [rows, cols / group] ([rows] per channel)."""
    groups = (rows,) if group_size is None else (rows, cols // group_size)
    codes = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return codes, torch.rand(groups, generator=gen) * 0.01 + 0.001, torch.randn(groups, generator=gen) * 0.05


def int8_weight(codes, scales, zeros, group_size: int | None) -> torch.Tensor:
    """The reference: W = q * s + z in float32, from the scales and zeros as the layer holds them."""
    def expand(per_group: torch.Tensor) -> torch.Tensor:
        per_group = per_group.float().reshape(codes.shape[0], -1)
        return per_group.repeat_interleave(codes.shape[1] // per_group.shape[1], dim=1)

    return codes.float() * expand(scales) + expand(zeros)


@pytest.mark.parametrize("cpu_op", [True, False], ids=["with-op", "without-op"])
@pytest.mark.parametrize("group_size", [None, 16, 32], ids=["per-channel", "group16", "group32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int8_with_zeros_multiplies_by_q_times_s_plus_z(monkeypatch, dtype, group_size, cpu_op):
    """W = q * s + z; torch's CPU int8 op has no zeros, so even a per-channel bfloat16 layer dequantizes."""
    if cpu_op and not HAS_INT8_OP:
        pytest.skip("this torch has no CPU int8 op")
    monkeypatch.setattr(int8, "int8_cpu_op_available", lambda: cpu_op)
    gen = torch.Generator().manual_seed(11)
    layer = RowParallelLinear(256, 24, bias=True).to(dtype)
    layer.set_method(Int8LinearMethod(group_size, zeros=True))
    codes, scales, zeros = random_int8(24, 256, group_size, gen)
    assert layer.zeros.dtype == dtype and layer.zeros.shape == scales.shape
    load(layer, {"qweight": codes, "scales": scales, "zeros": zeros, "bias": torch.randn(24, generator=gen)})
    assert layer.int8_channel_scales is None and layer.dequantized_weight.dtype == dtype
    weight = int8_weight(codes, layer.scales, layer.zeros, group_size)
    if dtype == torch.float32:
        assert torch.equal(layer.dequantized_weight, weight)
    for tokens in (1, 7):
        x = torch.randn(tokens, 256, generator=gen).to(dtype)
        assert_product(layer(x), x, weight, layer.bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int8_zeros_parts_and_shards_land_in_whole_groups(monkeypatch, dtype):
    """Rank 1 of 2: the fused q|k|v layer holds the second half of each projection's rows of codes, scales and
    zeros, o_proj the second half of its columns (groups of 16 from 128 / 16 on); each product is the rank's
    slice of W."""
    monkeypatch.setattr(distributed, "_state", distributed.ParallelState(rank=1, world_size=2))
    gen = torch.Generator().manual_seed(12)
    qkv = FusedLinear(256, {"q_proj": 32, "k_proj": 16, "v_proj": 16}, bias=False,
                      source_rows={"q_proj": (32, 32), "k_proj": (16, 16), "v_proj": (16, 16)}).to(dtype)
    o_proj = RowParallelLinear(256, 32, bias=False).to(dtype)
    for layer in (qkv, o_proj):
        layer.set_method(Int8LinearMethod(16, zeros=True))
    full = {name: random_int8(rows, 256, 16, gen) for name, rows in
            (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", 32))}
    tensors = {f"{name}.{param}": t for name, parts in full.items()
               for param, t in zip(("qweight", "scales", "zeros"), parts)}
    model = torch.nn.ModuleDict({"qkv_proj": qkv, "o_proj": o_proj})
    assert load_checkpoint_weights(model, tensors.items()) == set(tensors)
    rows = {"q_proj": slice(32, 64), "k_proj": slice(16, 32), "v_proj": slice(16, 32)}
    as_held = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    for param in ("qweight", "scales", "zeros"):  # as loaded (on the CPU the codes go once W is dequantized)
        assert torch.equal(getattr(qkv, param), torch.cat([as_held[f"{p}.{param}"][r] for p, r in rows.items()]))
    assert torch.equal(o_proj.qweight, as_held["o_proj.qweight"][:, 128:])
    assert torch.equal(o_proj.zeros, as_held["o_proj.zeros"][:, 8:])
    process_weights_after_loading(model)
    weights = {name: int8_weight(codes, as_held[f"{name}.scales"], as_held[f"{name}.zeros"], 16)
               for name, (codes, _, _) in full.items()}
    x = torch.randn(4, 256, generator=gen).to(dtype)
    assert_product(qkv(x), x, torch.cat([weights[p][r] for p, r in rows.items()]), None)
    assert_product(o_proj.method.apply(o_proj, x[:, 128:], None), x[:, 128:], weights["o_proj"][:, 128:], None)


def test_int8_checks_its_zeros():
    """Zeros are a parameter only with ``zeros=True``, in the scales' dtype and shape."""
    layer = RowParallelLinear(64, 16, bias=False)
    layer.set_method(Int8LinearMethod(32, zeros=True))
    assert tuple(layer.zeros.shape) == (16, 2)
    layer.set_method(Int8LinearMethod(32))
    assert not hasattr(layer, "zeros") and set(layer.param_layouts) == {"qweight", "scales"}
    layer.set_method(Int8LinearMethod(32, zeros=True))
    layer.set_param("zeros", torch.zeros(16, 2, dtype=torch.float64), WeightLayout(0, 1, 1, 32))
    with pytest.raises(ValueError, match=r"needs a \(16, 2\) float32 zeros, has \(16, 2\) float64"):
        process_weights_after_loading(layer)
