"""The int4 and int8 weight methods (``engine.models.linear.int4``, ``int8``): every product is x times the
dequantized weight, with torch's CPU ops and without them, and checkpoint parts and tensor-parallel shards land in
whole bytes and groups. GGUF's blocks converted for them, and int8 with zero points: tests/test_gguf_blocks.py."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import distributed
from engine.models.linear import (
    FusedLinear,
    Int4LinearMethod,
    Int8LinearMethod,
    RowParallelLinear,
    WeightLayout,
    int4,
    int8,
    pack_int4,
    process_weights_after_loading,
)
from engine.models.weight_loading import load_checkpoint_weights

HAS_INT4_OP = int4.int4_cpu_op_available()
HAS_INT8_OP = int8.int8_cpu_op_available()


def random_int4(rows: int, cols: int, group_size: int, gen: torch.Generator):
    """Codes [rows, cols] in 0-15, and float32 scales and zeros [rows, cols / group]."""
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scales = torch.rand(rows, cols // group_size, generator=gen) * 0.04 + 0.01
    zeros = torch.randn(rows, cols // group_size, generator=gen) * 0.02
    return codes, scales, zeros


def int4_weight(codes, scales, zeros, group_size: int) -> torch.Tensor:
    """The reference: W = (q - 8) * s + z in float32, from the scales and zeros as the layer holds them."""
    def expand(per_group: torch.Tensor) -> torch.Tensor:
        return per_group.float().repeat_interleave(group_size, dim=1)

    return (codes.float() - 8) * expand(scales) + expand(zeros)


def load(layer, tensors: dict) -> None:
    model = torch.nn.ModuleDict({"proj": layer})
    assert load_checkpoint_weights(model, [(f"proj.{name}", t) for name, t in tensors.items()]) == {
        f"proj.{name}" for name in tensors}
    process_weights_after_loading(model)


def assert_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    ref = x.float() @ weight.T + (0 if bias is None else bias.float())
    assert y.dtype == x.dtype and y.shape == ref.shape
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2  # bfloat16: W, x and the product rounded to 8 bits
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("cpu_op", [True, False], ids=["with-op", "without-op"])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int4_product_is_x_times_the_dequantized_weight(monkeypatch, dtype, group_size, cpu_op):
    """With torch's CPU op a bfloat16 layer multiplies through it; a float32 one (which the op would multiply
    unvectorized on x86) and any layer without the op dequantize."""
    if cpu_op and not HAS_INT4_OP:
        pytest.skip("this torch has no CPU int4 op")
    monkeypatch.setattr(int4, "int4_cpu_op_available", lambda: cpu_op)
    gen = torch.Generator().manual_seed(group_size)
    layer = RowParallelLinear(256, 48, bias=True).to(dtype)
    layer.set_method(Int4LinearMethod(group_size))
    assert layer.scales.dtype == dtype and layer.qweight.shape == (48, 128)
    codes, scales, zeros = random_int4(48, 256, group_size, gen)
    bias = torch.randn(48, generator=gen)
    load(layer, {"qweight": pack_int4(codes), "scales": scales, "zeros": zeros, "bias": bias})
    uses_op = cpu_op and dtype == torch.bfloat16
    assert (layer.int4_packed is not None, layer.dequantized_weight is None) == (uses_op, uses_op)
    weight = int4_weight(codes, layer.scales, layer.zeros, group_size)
    for tokens in (1, 7):
        x = torch.randn(tokens, 256, generator=gen).to(dtype)
        assert_product(layer(x), x, weight, layer.bias)
        assert torch.equal(layer.forward_deferred(x).finished(), layer(x))


@pytest.mark.skipif(not HAS_INT4_OP, reason="this torch has no CPU int4 op")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_cpu_int4_op_multiplies_by_q_minus_8_times_s_plus_z(dtype):
    """torch's op, as the method calls it: codes [out, in] int32 repacked; scales and zeros [in / group, out, 2] in
    x's dtype (scale first); group sizes 32 to 256 and a multiple of 16 output features."""
    gen = torch.Generator().manual_seed(1)
    for group_size in (32, 64, 128, 256):
        codes, scales, zeros = random_int4(32, 512, group_size, gen)
        codes[0] = 8  # code 8 is the zero: row 0 is z alone
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        scales_zeros = torch.stack((scales.t(), zeros.t()), dim=-1).to(dtype).contiguous()
        x = torch.randn(5, 512, generator=gen).to(dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)
        weight = int4_weight(codes, scales_zeros[..., 0].t(), scales_zeros[..., 1].t(), group_size)
        assert_product(y, x, weight, None)
    with pytest.raises(RuntimeError, match="qGroupSize"):
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 16, torch.zeros(32, 32, 2, dtype=dtype))


@pytest.mark.parametrize(("group_size", "out_features", "dtype"), [(16, 32, torch.bfloat16), (32, 40, torch.bfloat16),
                                                                    (32, 32, torch.float32), (32, 32, torch.float16)],
                         ids=["group16", "40-rows", "f32", "f16"])
def test_int4_layers_the_cpu_op_does_not_take_dequantize(group_size, out_features, dtype):
    gen = torch.Generator().manual_seed(2)
    layer = RowParallelLinear(128, out_features, bias=False).to(dtype)
    layer.set_method(Int4LinearMethod(group_size))
    codes, scales, zeros = random_int4(out_features, 128, group_size, gen)
    load(layer, {"qweight": pack_int4(codes), "scales": scales, "zeros": zeros})
    assert layer.int4_packed is None and layer.dequantized_weight.dtype == dtype
    x = torch.randn(3, 128, generator=gen).to(dtype)
    expected = x.float() @ int4_weight(codes, layer.scales, layer.zeros, group_size).T
    torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("cpu_op", [True, False], ids=["with-op", "without-op"])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int4_parts_and_shards_land_in_whole_bytes_and_groups(monkeypatch, dtype, group_size, cpu_op):
    """Rank 1 of 2: the fused q|k|v layer holds the second half of each projection's rows, o_proj the second half of
    its columns (bytes 64-127 of the codes, groups from 128 / group on); each product is the rank's slice of W."""
    if cpu_op and not HAS_INT4_OP:
        pytest.skip("this torch has no CPU int4 op")
    monkeypatch.setattr(int4, "int4_cpu_op_available", lambda: cpu_op)
    monkeypatch.setattr(distributed, "_state", distributed.ParallelState(rank=1, world_size=2))
    gen = torch.Generator().manual_seed(3)
    qkv = FusedLinear(256, {"q_proj": 32, "k_proj": 16, "v_proj": 16}, bias=True,
                      source_rows={"q_proj": (32, 32), "k_proj": (16, 16), "v_proj": (16, 16)}).to(dtype)
    o_proj = RowParallelLinear(256, 32, bias=True).to(dtype)
    for layer in (qkv, o_proj):
        layer.set_method(Int4LinearMethod(group_size))
    full = {name: random_int4(rows, 256, group_size, gen) for name, rows in
            (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", 32))}
    tensors = {f"{name}.{param}": t for name, (codes, scales, zeros) in full.items() for param, t in
               (("qweight", pack_int4(codes)), ("scales", scales), ("zeros", zeros))}
    tensors |= {f"{name}.bias": torch.randn(rows, generator=gen) for name, rows in
                (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", 32))}
    model = torch.nn.ModuleDict({"qkv_proj": qkv, "o_proj": o_proj})
    assert load_checkpoint_weights(model, tensors.items()) == set(tensors)
    process_weights_after_loading(model)
    assert (qkv.int4_packed is not None, o_proj.int4_packed is not None) == (cpu_op and dtype == torch.bfloat16,) * 2
    rows = {"q_proj": slice(32, 64), "k_proj": slice(16, 32), "v_proj": slice(16, 32)}
    as_held = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    for param in ("qweight", "scales", "zeros", "bias"):
        assert torch.equal(getattr(qkv, param), torch.cat([as_held[f"{p}.{param}"][r] for p, r in rows.items()]))
    assert torch.equal(o_proj.qweight, as_held["o_proj.qweight"][:, 64:])
    assert torch.equal(o_proj.scales, as_held["o_proj.scales"][:, 128 // group_size:])
    assert torch.equal(o_proj.bias, as_held["o_proj.bias"])
    weights = {name: int4_weight(codes, as_held[f"{name}.scales"], as_held[f"{name}.zeros"], group_size)
               for name, (codes, _, _) in full.items()}
    x = torch.randn(4, 256, generator=gen).to(dtype)
    assert_product(qkv(x), x, torch.cat([weights[p][r] for p, r in rows.items()]), qkv.bias)
    assert_product(o_proj.method.apply(o_proj, x[:, 128:], None), x[:, 128:], weights["o_proj"][:, 128:], None)


@pytest.mark.skipif(not HAS_INT4_OP, reason="this torch has no CPU int4 op")
@pytest.mark.parametrize("dense_bfloat16", [True, False], ids=["dense-bf16", "dense-f32"])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int4_products_of_many_tokens_dequantize_w_into_scratch(monkeypatch, dtype, group_size, dense_bfloat16):
    """Past ``INT4_CPU_OP_MAX_TOKENS`` tokens a layer that has the CPU op dequantizes W into this thread's scratch
    buffers and multiplies densely, in bfloat16 where oneDNN has it, else in float32 (then a float32 model's product
    is float32-exact): x times the dequantized weight either way, for a 3-D x and a strided one, and the same as the
    op gives within bfloat16's rounding. No copy of W stays on the layer; two layers share the buffers."""
    monkeypatch.setattr(int4, "dense_bfloat16", lambda: dense_bfloat16)
    monkeypatch.setattr(int4, "_SCRATCH", threading.local())  # this test's buffers, whatever ran before
    dequantized_product, calls = int4.cpu_dequantized_product, []

    def counted(layer, x, group):
        calls.append(x.shape[0])
        return dequantized_product(layer, x, group)

    monkeypatch.setattr(int4, "cpu_dequantized_product", counted)
    gen = torch.Generator().manual_seed(8)
    layers, weights = [], []
    for out_features in (48, 96):
        layer = RowParallelLinear(256, out_features, bias=True).to(dtype)
        layer.set_method(Int4LinearMethod(group_size, float32_in_bfloat16=True))
        codes, scales, zeros = random_int4(out_features, 256, group_size, gen)
        load(layer, {"qweight": pack_int4(codes), "scales": scales, "zeros": zeros,
                     "bias": torch.randn(out_features, generator=gen)})
        assert layer.int4_packed is not None and layer.dequantized_weight is None
        layers.append(layer)
        weights.append(int4_weight(codes, layer.scales, layer.zeros, group_size))
    many = int4.INT4_CPU_OP_MAX_TOKENS + 1
    for layer, weight in zip(layers, weights):
        x = torch.randn(2, many, 256, generator=gen).to(dtype)
        strided = torch.randn(many, 300, generator=gen).to(dtype)[:, 20:276]
        for batch in (x, strided):
            y = layer(batch)
            ref = batch.float() @ weight.T + layer.bias.float()
            exact = dtype == torch.float32 and not dense_bfloat16
            tol = 1e-5 if exact else 1e-2
            assert y.dtype == dtype and y.shape == ref.shape
            torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        dense = layer(x[0])[:-1].float()
        by_op = layer(x[0, :-1]).float()  # the op's product of the same tokens
        torch.testing.assert_close(by_op, dense, rtol=1e-2, atol=1e-2 * dense.abs().max().item())
    assert calls == [2 * many, many, many] * 2  # the 3-D x, the strided one, x[0]; the op for one token fewer
    assert all(layer.dequantized_weight is None for layer in layers)
    assert int4._SCRATCH.values.numel() == 96 * 256


def test_int4_checks_its_groups_and_parameters(monkeypatch):
    monkeypatch.setattr(distributed, "_state", distributed.ParallelState(rank=1, world_size=2))
    with pytest.raises(ValueError, match="96 input features do not divide into int4 groups of 64"):
        RowParallelLinear(192, 32, bias=False).set_method(Int4LinearMethod(64))
    with pytest.raises(ValueError, match="must be even"):
        Int4LinearMethod(33)
    layer = RowParallelLinear(192, 32, bias=False)
    layer.set_method(Int4LinearMethod(32))
    layer.set_param("zeros", torch.zeros(32, 3, dtype=torch.float64), WeightLayout(0, 1, 1, 32))
    with pytest.raises(ValueError, match=r"needs a \(32, 3\) float32 zeros, has \(32, 3\) float64"):
        process_weights_after_loading(layer)


@pytest.mark.parametrize("cpu_op", [True, False], ids=["with-op", "without-op"])
@pytest.mark.parametrize("group_size", [None, 32], ids=["per-channel", "group32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int8_product_is_x_times_the_dequantized_weight(monkeypatch, dtype, group_size, cpu_op):
    """The CPU op takes one scale per output channel, and is used in bfloat16: Q8_0's group scales, and float32
    layers, are dequantized whatever the torch."""
    if cpu_op and not HAS_INT8_OP:
        pytest.skip("this torch has no CPU int8 op")
    monkeypatch.setattr(int8, "int8_cpu_op_available", lambda: cpu_op)
    gen = torch.Generator().manual_seed(4)
    layer = RowParallelLinear(256, 24, bias=True).to(dtype)
    layer.set_method(Int8LinearMethod(group_size))
    codes = torch.randint(-127, 128, (24, 256), generator=gen, dtype=torch.int8)
    scales = torch.rand((24,) if group_size is None else (24, 256 // group_size), generator=gen) * 0.01
    load(layer, {"qweight": codes, "scales": scales, "bias": torch.randn(24, generator=gen)})
    uses_op = cpu_op and group_size is None and dtype == torch.bfloat16
    assert (layer.int8_channel_scales is not None, layer.dequantized_weight is None) == (uses_op, uses_op)
    per_row = layer.scales.float().reshape(24, -1)  # [24, 1] or [24, 8]
    weight = codes.float() * per_row.repeat_interleave(256 // per_row.shape[1], dim=1)
    for tokens in (1, 7):
        x = torch.randn(tokens, 256, generator=gen).to(dtype)
        assert_product(layer(x), x, weight, layer.bias)


def _head_int8(rows: int, cols: int, gen: torch.Generator, zeros: bool):
    """An int8 form as GGUF's Q8_0 (no zeros) or Q5_1 (zeros) give it: codes, scales, zeros or None, groups of 32;
    and W = q s + z in float32."""
    codes = torch.randint(-128, 128, (rows, cols), generator=gen).to(torch.int8)
    scales = torch.rand(rows, cols // 32, generator=gen) * 0.004 + 0.001
    offsets = torch.randn(rows, cols // 32, generator=gen) * 0.02 if zeros else None
    weight = codes.float() * scales.repeat_interleave(32, dim=1)
    if offsets is not None:
        weight += offsets.repeat_interleave(32, dim=1)
    return codes, scales, offsets, weight


@pytest.mark.skipif(not HAS_INT4_OP, reason="this torch has no CPU int4 op")
@pytest.mark.parametrize("form", ["int8", "int8-zeros", "int4"])
def test_a_head_copy_multiplies_within_its_error_bounds(form):
    """A head's copy for the CPU op (``CpuInt4OpWeight``): an int8 form held as two 4-bit planes, or an int4 one,
    multiplies as its dequantized weight does up to bfloat16's rounding, and every product lies within the bounds
    ``greedy_tokens`` relies on."""
    gen = torch.Generator().manual_seed(3)
    if form == "int4":
        codes, scales, zeros = random_int4(256, 128, 32, gen)
        weight = int4_weight(codes, scales, zeros, 32)
        copy = int4.CpuInt4OpWeight.from_int4(pack_int4(codes), scales, zeros, 32)
    else:
        codes, scales, zeros, weight = _head_int8(256, 128, gen, zeros=form == "int8-zeros")
        copy = int4.CpuInt4OpWeight.from_int8(codes, scales, zeros, 32)
    for scale in (0.1, 1.0, 30.0):
        x = torch.randn(3, 128, generator=gen) * scale
        products, exact = copy(x), x @ weight.T
        assert products.dtype == torch.float32
        torch.testing.assert_close(products, exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())
        assert ((products - exact).abs() <= copy.error_bounds(x, products)).all()


@pytest.mark.skipif(not HAS_INT4_OP, reason="this torch has no CPU int4 op")
def test_a_head_copys_greedy_tokens_are_the_dense_argmax_even_at_near_ties():
    """Rows whose logits differ by far less than bfloat16 resolves still get the dense product's argmax, and an
    exact tie goes to the lower id, as torch.argmax: the copy only narrows the candidates."""
    gen = torch.Generator().manual_seed(5)
    codes, scales, _, _ = _head_int8(512, 256, gen, zeros=False)
    x = torch.randn(4, 256, generator=gen)
    x[:, 7] = x[:, 7].abs() + 0.5  # column 7 positive in every row: one code more there raises a logit a little
    weight = codes.float() * scales.repeat_interleave(32, dim=1)
    best = (x @ weight.T).argmax(dim=-1)
    # Row 0: id 40 a copy of its best one, one code higher in column 7 (if it can be; else lower there, so it loses).
    # Row 1: id 41 an exact copy of its best: a tie, to the lower id. Rows 2 and 3 stay as they are.
    for row, twin, bump in ((0, 40, 1), (1, 41, 0)):
        src = int(best[row])
        codes[twin], scales[twin] = codes[src], scales[src]
        if bump:
            code = int(codes[twin, 7])
            codes[twin, 7] = code + 1 if code < 127 else code - 1
    weight = codes.float() * scales.repeat_interleave(32, dim=1)
    logits = x @ weight.T
    expected = logits.argmax(dim=-1)
    assert int(expected[1]) == min(41, int(best[1]))
    gap = (logits[0, 40] - logits[0, int(best[0])]).abs()
    assert 0 < gap < 2**-9 * logits[0].abs().max()  # below what a bfloat16 product tells apart
    copy = int4.CpuInt4OpWeight.from_int8(codes, scales, None, 32)
    assert torch.equal(copy.greedy_tokens(x, weight), expected)
    for rows in (1, 2):
        assert torch.equal(copy.greedy_tokens(x[:rows], weight), expected[:rows])
