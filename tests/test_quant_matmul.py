"""The int4 and int8 weight kernels (``engine.ops.quant_matmul``) against torch: W dequantized by the methods'
own torch code (``dequantize_int4``, ``dequantize_int8``), then ``x @ W^T`` in float32.

On a GPU they run compiled on CUDA tensors; without one in Triton's interpreter on CPU tensors (conftest sets
``TRITON_INTERPRET=1``). Float32 and float16 activations are checked tightly; bfloat16 loosely in the interpreter,
which casts to bfloat16 by truncation.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from engine.models.linear.int4 import dequantize_int4, pack_int4  # noqa: E402
from engine.models.linear.int8 import dequantize_int8  # noqa: E402
from engine.ops.quant_gemv import GemvTiles, choose_gemv_tiles  # noqa: E402
from engine.ops.quant_matmul import (  # noqa: E402
    QuantWeight,
    Tiles,
    block_k_for,
    choose_product_tiles,
    choose_tiles,
    dequantize,
    quant_matmul,
    quant_matmul_partials,
)

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: run with TRITON_INTERPRET=1 to test the kernels on the CPU", allow_module_level=True)


def _weight(bits: int, n: int, k: int, group: int | None, dtype: torch.dtype, zeros: bool, seed: int,
            rounded: bool = True):
    """A random quantized W and the same W dequantized by the methods' torch code, [n, k] float32: rounded to
    ``dtype`` as the tensor-core kernel rounds it, or not (``rounded`` False) as the GEMV takes it."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group is None else k // group
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(dtype)
    zero = (torch.randn(n, groups, generator=gen) * 0.02).to(dtype) if zeros else None
    if bits == 4:
        codes = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
        ref = dequantize_int4(codes, scales.float(), torch.zeros(n, groups) if zero is None else zero.float(),
                              k // groups)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        ref = dequantize_int8(codes, scales.float())
        if zero is not None:
            ref += zero.float().repeat_interleave(k // groups, dim=1)
    if group is None and bits == 8:
        scales = scales[:, 0].contiguous()
    weight = QuantWeight(codes.to(DEVICE), scales.to(DEVICE), None if zero is None else zero.to(DEVICE), bits,
                         k if group is None else group)
    return weight, ref.to(dtype).float() if rounded else ref


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    error = float((got.float().cpu() - want).norm() / want.norm())
    # bfloat16 on CUDA: the product and each slice's partial product are rounded to bfloat16 (unit roundoff 2^-9,
    # ~1.1e-3 rms each), measured 2.1-2.3e-3 at one token over 48-96 outputs; a wrong code, group or scale is ~1
    limit = 1e-5 if dtype == torch.float32 else 2e-3 if dtype == torch.float16 else 4e-3 if DEVICE == "cuda" else 2e-2
    assert error < limit, f"relative error {error:.2e} over {limit:.0e}"


CASES = [  # bits, N, K, group, zeros
    (4, 96, 256, 32, True),  # GGUF Q4_1-like: groups narrower than a K step
    (4, 64, 256, 128, True),  # AWQ/GPTQ's usual group: one group per K step
    (4, 80, 192, 64, False),  # K steps of 64 columns; N not a multiple of the weight tile
    (8, 64, 256, 32, False),  # GGUF Q8_0
    (8, 48, 128, 16, True),  # int8 with zeros and groups of 16 (5- and 6-bit GGUF blocks held as int8)
    (8, 64, 256, None, False),  # one scale per row
]


@pytest.mark.parametrize("bits,n,k,group,zeros", CASES)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_quant_matmul_matches_dequantized_product(bits, n, k, group, zeros, m):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    weight, ref_w = _weight(bits, n, k, group, dtype, zeros, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    want = x.float() @ ref_w.t()
    if isinstance(choose_product_tiles(m, n, k, weight.group, bits, num_sms=132), GemvTiles):
        exact = x.float() @ _weight(bits, n, k, group, dtype, zeros, seed=m + n, rounded=False)[1].t()
        _close(quant_matmul(x.to(DEVICE), weight), exact, dtype)
    else:
        _close(quant_matmul(x.to(DEVICE), weight), want, dtype)
    # K cut into slices, summed by the second launch and handed over as partial products
    block_k = block_k_for(k, weight.group, 64)
    split = 2 if (k // block_k) % 2 == 0 else 3
    tiles = Tiles(16, 32, block_k, split, 4, 2)
    _close(quant_matmul(x.to(DEVICE), weight, tiles), want, dtype)
    parts = quant_matmul_partials(x.to(DEVICE), weight, tiles)
    assert parts.shape == (split, m, n)
    _close(parts.float().sum(0), want, dtype)


@pytest.mark.parametrize("n,k,group,zeros", [(96, 256, 32, True), (64, 512, 128, True), (80, 192, 64, False),
                                             (48, 256, 256, False)])
@pytest.mark.parametrize("m", [1, 3])
def test_int4_gemv_matches_dequantized_product(n, k, group, zeros, m):
    """The few-token GEMV: groups narrower than its K step, as wide, and one group spanning several steps; N not a
    multiple of its rows; K whole, cut in slices summed after, and handed over as partial products."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    weight, ref_w = _weight(4, n, k, group, dtype, zeros, seed=m + n, rounded=False)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    want = x.float() @ ref_w.t()
    chosen = choose_gemv_tiles(1, n, k, group, num_sms=132)
    assert isinstance(chosen, GemvTiles)
    _close(quant_matmul(x.to(DEVICE), weight, chosen), want, dtype)
    block_k = 64 if k % 128 else 128
    split = k // block_k // 2 if (k // block_k) % 2 == 0 else 1
    tiles = GemvTiles(16, block_k, split, 4)
    _close(quant_matmul(x.to(DEVICE), weight, tiles), want, dtype)
    parts = quant_matmul_partials(x.to(DEVICE), weight, tiles)
    assert parts.shape == (split, m, n)
    _close(parts.float().sum(0), want, dtype)


def test_gemv_only_for_few_int4_tokens():
    assert isinstance(choose_product_tiles(1, 4096, 4096, 128, 4, num_sms=132), GemvTiles)
    assert not isinstance(choose_product_tiles(2, 4096, 4096, 128, 4, num_sms=132), GemvTiles)
    assert not isinstance(choose_product_tiles(1, 4096, 4096, 32, 8, num_sms=132), GemvTiles)  # int8: tensor cores
    assert choose_gemv_tiles(1, 64, 96, 32, num_sms=132) is None  # K of 96 is not cut into steps of 64
    one = choose_gemv_tiles(1, 4096, 4096, 128, num_sms=132)
    assert 4096 % (one.block_k * one.split) == 0 and one.split > 1
    assert choose_gemv_tiles(1, 28672, 4096, 128, num_sms=132).split == 1  # its 896 tiles fill the SMs


@pytest.mark.parametrize("bits,n,k,group,zeros", CASES[:2] + CASES[4:5])
def test_dequantize_is_the_torch_dequantization(bits, n, k, group, zeros):
    weight, ref_w = _weight(bits, n, k, group, torch.float32, zeros, seed=3)
    torch.testing.assert_close(dequantize(weight, torch.float32).cpu(), ref_w, rtol=1e-6, atol=1e-7)


def test_empty_batch_and_shape_checks():
    weight, _ = _weight(4, 64, 128, 32, torch.float32, True, seed=1)
    assert quant_matmul(torch.empty(0, 128, device=DEVICE), weight).shape == (0, 64)
    with pytest.raises(ValueError, match="does not match"):
        quant_matmul(torch.zeros(2, 64, device=DEVICE), weight)


def test_choose_tiles_cuts_k_only_while_the_gpu_is_not_full():
    one = choose_tiles(1, 4096, 4096, 128, num_sms=132)
    assert one.block_m == 16 and one.split > 1 and 4096 % (one.block_k * one.split) == 0
    wide = choose_tiles(256, 28672, 4096, 128, num_sms=132)
    assert wide.split == 1
    assert choose_tiles(1, 64, 100, 32, num_sms=132) is None  # K of 100 is not cut into steps of 32
